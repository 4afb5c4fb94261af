"""rendezvous-check: what the launchers run before torchrun (not a DVC stage)."""

import click

from pipeline import rendezvous


@click.command("rendezvous-check", short_help="Check a torchrun rendezvous address, in seconds.")
@click.option("--endpoint", required=True, metavar="HOST:PORT", help="torchrun's --rdzv-endpoint.")
@click.option("--host/--client", "is_host", default=False,
              help="This node hosts the rendezvous (torchrun's is_host=1), or joins it.")
@click.option("--wait", "wait_s", default=300.0, show_default=True,
              help="Seconds a joining node waits for the first node's rendezvous to accept.")
def rendezvous_check(endpoint: str, is_host: bool, wait_s: float) -> None:
    """Fail in seconds, with the reason, where torchrun would hang: the rendezvous port held by
    another program on the first node."""
    host, port = rendezvous.parse_endpoint(endpoint)
    if is_host:
        rendezvous.check_host_port(host, port)
    else:
        rendezvous.check_client(host, port, wait_s)
