"""One typed, frozen view of params.yaml.

Each top-level section of params.yaml is a frozen dataclass; every field carries its rule. Loading
rejects unknown sections and keys, wrong types and impossible values with one message that names
the key, the value and what is allowed, so a typo in `dvc exp run -S` fails before any work starts.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import yaml

from pipeline.errors import ConfigError

MODES = ("single", "dp", "ddp", "fsdp")
DEFAULT_MODES = MODES[:3]  # what params.yaml trains: fsdp is asked for (docs/ddp.md)
FSDP_SHARDING = ("full", "hybrid")
CHECKPOINT_FORMATS = ("whole", "sharded", "sharded-async")
# The modes that train in several processes, one per device, each a rank of one process group:
# DistributedDataParallel's copies of the model, and FSDP2's shards of it (fully_shard).
DISTRIBUTED = ("ddp", "fsdp")
LAUNCHERS = ("local", "slurm")
DEVICES = ("auto", "cuda", "cpu")
OPTIMIZERS = ("adam", "adamw", "sgd")  # built by pipeline.optim
SCHEDULES = ("onecycle", "cosine", "constant")
LOADERS = ("memory", "dataloader")  # pipeline.batches
MNIST_TRAIN_SIZE = 60_000


def _rule(check: Callable[[Any], bool], allowed: str) -> dict:
    return {"check": check, "allowed": allowed}


def _at_least(low: float) -> dict:
    return _rule(lambda v: v >= low, f">= {low}")


def _positive() -> dict:
    return _rule(lambda v: v > 0, "> 0")


# torch.manual_seed takes up to 64 bits; the loop adds the epoch and the rank to the seed.
_SEED = _rule(lambda v: 0 <= v < 2**63, "an integer from 0 to 2**63 - 1")


@dataclass(frozen=True)
class DataConfig:
    seed: int = field(default=42, metadata=_SEED)
    val_size: int = field(default=5000, metadata=_at_least(1))
    # 0 keeps every training image; N keeps the first N (quick runs).
    train_limit: int = field(default=0, metadata=_at_least(0))
    verify_checksums: bool = True

    def __post_init__(self) -> None:
        available = self.train_limit or MNIST_TRAIN_SIZE
        if self.val_size >= available:
            raise ConfigError(
                f"data.val_size = {self.val_size} leaves no training images "
                f"(training set: {available}); allowed: data.val_size < "
                f"{'data.train_limit' if self.train_limit else MNIST_TRAIN_SIZE}"
            )


def distributed(mode: str | None) -> bool:
    return mode in DISTRIBUTED


@dataclass(frozen=True)
class TrainConfig:
    modes: tuple[str, ...] = field(
        default=DEFAULT_MODES,
        metadata=_rule(lambda v: len(v) > 0 and set(v) <= set(MODES), f"a non-empty list of {MODES}"),
    )
    epochs: int = field(default=1, metadata=_at_least(1))
    # The global batch: the same in every mode; DDP splits it across ranks.
    batch_size: int = field(default=128, metadata=_at_least(1))
    # The optimizer and its learning-rate schedule (pipeline.optim): lr is the schedule's peak
    # (onecycle) or its start (cosine, constant); momentum is SGD's (Adam and AdamW have betas).
    optimizer: str = field(default="adam", metadata=_rule(lambda v: v in OPTIMIZERS, f"one of {OPTIMIZERS}"))
    schedule: str = field(default="onecycle", metadata=_rule(lambda v: v in SCHEDULES, f"one of {SCHEDULES}"))
    lr: float = field(default=0.02, metadata=_positive())
    momentum: float = field(default=0.9, metadata=_rule(lambda v: 0 <= v < 1, "from 0 up to, not including, 1"))
    weight_decay: float = field(default=0.0, metadata=_at_least(0))
    # Clips the gradient to this global (L2) norm before each step; 0: never.
    max_grad_norm: float = field(default=0.0, metadata=_at_least(0))
    # Gradient accumulation: each rank's share of the global batch in this many micro-batches, one
    # forward and backward each, then one optimizer step (the same global batch, less activation
    # memory; DDP all-reduces once, after the last).
    grad_accum_steps: int = field(default=1, metadata=_at_least(1))
    # Also checkpoint every this many steps, mid-epoch (0: at each epoch's end only). A resume goes on
    # from the next step, with the same weights, bit for bit, as an uninterrupted training's.
    checkpoint_every_steps: int = field(default=0, metadata=_at_least(0))
    # "whole": rank 0 gathers the model and optimizer state and writes one file (node-local disks do);
    # "sharded": each rank writes its own part (torch.distributed.checkpoint, pipeline.shards), in a
    # folder every rank must share; "sharded-async": the same, written in a thread while the training
    # goes on. The training's last checkpoint is whole either way.
    checkpoint_format: str = field(default="whole", metadata=_rule(lambda v: v in CHECKPOINT_FORMATS,
                                                                   f"one of {CHECKPOINT_FORMATS}"))
    seed: int = field(default=42, metadata=_SEED)
    # DDP workers on this node (with slurm: on each node); 0 = one per GPU, or 2 on a CPU-only host
    # (under slurm: one per GPU Slurm gives the node, else 1).
    nproc: int = field(default=0, metadata=_at_least(0))
    # How ddp starts: "local" (torchrun's launcher on this machine) or "slurm" (`sbatch --wait
    # deploy/slurm/train.sbatch`, one torchrun per node; this directory must be shared by the nodes).
    launcher: str = field(default="local", metadata=_rule(lambda v: v in LAUNCHERS, f"one of {LAUNCHERS}"))
    # slurm: the nodes the ddp job asks for.
    nodes: int = field(default=1, metadata=_at_least(1))
    # slurm: CPU cores the job asks for per worker (sbatch --cpus-per-task = this x workers a node):
    # without it a site that gives a job one core unless asked puts every worker on that core.
    cpus_per_rank: int = field(default=4, metadata=_at_least(1))
    # slurm: memory the job asks for per worker, in GB (sbatch --mem = this x workers a node): a
    # site's default memory per CPU can be too small for CUDA workers, which it then kills.
    mem_per_rank_gb: float = field(default=8.0, metadata=_positive())
    # auto: the GPUs when there are any, else the CPU. cuda: GPUs or a clear error (a Slurm job asks
    # for them); cpu: the CPU even where GPUs are.
    device: str = field(default="auto", metadata=_rule(lambda v: v in DEVICES, f"one of {DEVICES}"))
    # CUDA only: bf16 autocast (false: full float32, TF32 off too) and channels_last memory format.
    bf16: bool = True
    # fp16 autocast with a loss scaler, in place of bf16, on any device: for GPUs without native
    # bf16 (V100, T4). On the CPU it trains, slowly; it is there to be tested.
    fp16: bool = False
    channels_last: bool = True
    # ddp: the model's BatchNorm layers as SyncBatchNorm, normalising by the global batch's
    # statistics, as one device does (docs/workloads.md): torch's on GPUs, pipeline.gloo_batchnorm's
    # on the CPU, where torch's has no kernel.
    sync_batchnorm: bool = False
    # fsdp: "full" shards every parameter over all the ranks; "hybrid" shards within each node and
    # replicates across nodes (HSDP: a 2-D mesh), so only a gradient all-reduce crosses between nodes.
    fsdp_sharding: str = field(default="full", metadata=_rule(lambda v: v in FSDP_SHARDING, f"one of {FSDP_SHARDING}"))
    # torch.compile (TorchInductor) the model each mode trains (pipeline.compiled): the first steps
    # compile it, the rest run its generated kernels. They round otherwise than eager's: the modes
    # agree within rounding, and runs and resumes repeat bit for bit. Needs a C/C++ compiler.
    compile: bool = False
    # Deterministic algorithms (cuDNN, cuBLAS, torch): identical runs and resumes give the same
    # bits on GPUs too, at some speed there; the CPU's ops are deterministic either way.
    deterministic: bool = True
    eval_batch_size: int = field(default=2000, metadata=_at_least(1))
    # Where each step's samples come from (pipeline.batches): "memory", the whole split on the device,
    # gathered by index (the fastest, for data that fits), or "dataloader", a torch DataLoader reading
    # each rank's samples from the prepared files as the steps need them. Every mode sees the same
    # global batches either way: the same weights, bit for bit.
    loader: str = field(default="memory", metadata=_rule(lambda v: v in LOADERS, f"one of {LOADERS}"))
    # dataloader: its worker processes on each rank (0: read in the training process itself).
    loader_workers: int = field(default=2, metadata=_at_least(0))
    # Steps of each epoch left out of the steady-state throughput (samples/s after the warm-up),
    # which the report's speed-ups use; the whole-epoch figure stands beside it.
    throughput_warmup_steps: int = field(default=10, metadata=_at_least(0))
    # The step breakdown (pipeline.breakdown): this many steps of the last epoch, after the warm-up,
    # timed phase by phase and bucket by bucket (0 = off: no comm hook, no trace).
    breakdown_steps: int = field(default=20, metadata=_at_least(0))
    # Windows of breakdown_steps, spread over the last epoch's steps after the warm-up (as many as
    # fit): the steps the step time's median and its interval come from (pipeline.spread).
    breakdown_repeats: int = field(default=10, metadata=_at_least(1))
    # Then this many steps under torch.profiler, whose trace goes to each rank's MLflow run.
    trace_steps: int = field(default=2, metadata=_at_least(0))

    def __post_init__(self) -> None:
        if self.grad_accum_steps > self.batch_size:  # DDP's ranks' shares: parallel.check_world_size
            raise ConfigError(f"train.grad_accum_steps = {self.grad_accum_steps} is more than train.batch_size = "
                              f"{self.batch_size}, so some micro-batches would hold no sample; allowed: "
                              "train.grad_accum_steps <= train.batch_size")


# A Python name (a module, a class): letters, digits and underscores, not starting with a digit.
_IDENTIFIER = r"[A-Za-z_][A-Za-z0-9_]*"
_CLASS_PATH = re.compile(rf"{_IDENTIFIER}(\.{_IDENTIFIER})+")
_IDENTIFIER_RE = re.compile(_IDENTIFIER)
MNIST_WORKLOAD = "pipeline.workloads.mnist.Mnist"


@dataclass(frozen=True)
class WorkloadConfig:
    # What trains (pipeline.workloads): a class named by its import path, from this package or from
    # a module of the project's own, built with init_args as its keyword arguments (its model, its
    # loss, its metrics). It is imported, built and tried on its own example batch before anything
    # on disk changes.
    class_path: str = field(default=MNIST_WORKLOAD, metadata=_rule(
        lambda v: bool(_CLASS_PATH.fullmatch(v)), "an import path, module.Class (e.g. workloads.teamwork.Mlp)"))
    # Not hashed: a dict.
    init_args: dict = field(default_factory=lambda: {"model": "small", "label_smoothing": 0.1}, hash=False, metadata=_rule(
        lambda v: all(isinstance(k, str) and _IDENTIFIER_RE.fullmatch(k) for k in v),
        "a mapping of keyword-argument names to values"))


@dataclass(frozen=True)
class TrackingConfig:
    enabled: bool = True
    experiment: str = field(default="mnist-data-parallel",
                            metadata=_rule(lambda v: bool(v.strip()), "a non-empty name"))
    # MLflow's CPU, memory and GPU metrics, sampled every interval on each machine.
    system_metrics: bool = True
    system_metrics_interval_s: float = field(default=2.0, metadata=_positive())
    # 0: per-epoch metrics only; N: also each rank's loss every N steps (sent once per epoch).
    log_every_n_steps: int = field(default=0, metadata=_at_least(0))
    # Training never waits on the tracking server: what it cannot send is kept and sent when it
    # answers. At the end, the stage waits this long for it, then fails saying how to send the rest.
    outage_wait_s: float = field(default=120.0, metadata=_at_least(0))
    # "": no registry. A name: each mode's model becomes a version of this registered model, with
    # the mode as its alias, so `models:/<name>@ddp` loads what ddp trained.
    registered_model: str = field(default="", metadata=_rule(
        lambda v: v == "" or (v.strip() == v and not set(v) & set("/:")), 'a name without "/" or ":" (or "" for off)'))


@dataclass(frozen=True)
class CommcheckConfig:
    # false: the stage records that it was skipped and the pipeline goes on.
    enabled: bool = True
    min_bytes: int = field(default=4, metadata=_at_least(4))
    max_bytes: int = field(default=4 * 2**20, metadata=_at_least(4))
    factor: int = field(default=4, metadata=_at_least(2))
    warmup: int = field(default=3, metadata=_at_least(0))
    iters: int = field(default=10, metadata=_rule(lambda v: 1 <= v <= 1000, "from 1 to 1000"))
    # Seconds the whole sweep may take, shared evenly by the primitives: each stops growing its
    # message before the next size would overrun its share (every size up to max_bytes on a fast
    # interconnect, fewer on a slow one). 0 = every size up to max_bytes, however long it takes.
    budget_s: float = field(default=2.0, metadata=_at_least(0))

    def __post_init__(self) -> None:
        if self.max_bytes < self.min_bytes:
            raise ConfigError(f"commcheck.max_bytes = {self.max_bytes} is below commcheck.min_bytes = "
                              f"{self.min_bytes}; allowed: max_bytes >= min_bytes")


GATE = re.compile(r"^\s*([A-Za-z_]\w*)\s*(>=|<=)\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*$")


def parse_gate(text: str) -> tuple[str, str, float] | None:
    """evaluate.gate, "abs_error <= 0.5": (metric, ">=" or "<=", bound); None where it is empty."""
    if not text.strip():
        return None
    name, op, bound = GATE.match(text).groups()
    return name, op, float(bound)


@dataclass(frozen=True)
class EvaluateConfig:
    batch_size: int = field(default=2000, metadata=_at_least(1))
    # The quality gate: a model below this test accuracy fails the evaluate stage (and dvc repro).
    min_test_accuracy: float = field(default=0.9, metadata=_rule(lambda v: 0 <= v <= 1, "between 0 and 1"))
    # Another test score's bound, for any workload: "<metric> >= <number>" or "<metric> <= <number>".
    gate: str = field(default="", metadata=_rule(lambda v: not v.strip() or GATE.match(v) is not None,
                                                 "'' or '<metric> >= <number>' or '<metric> <= <number>'"))


@dataclass(frozen=True)
class CompareConfig:
    # The scaling model's projection (pipeline.scaling): DDP at these device counts, on commcheck's
    # measured link and on each named link below (nominal figures: edit them to your hardware).
    devices: tuple[int, ...] = field(default=(8, 64, 512), metadata=_rule(
        lambda v: len(v) > 0 and all(n >= 2 for n in v), "a non-empty list of device counts >= 2"))
    link_names: tuple[str, ...] = ("nvlink", "infiniband", "ethernet")
    # Each link's all-reduce bus bandwidth in GB/s (nccl-tests' busbw) and its latency per ring step.
    link_busbw_gbps: tuple[float, ...] = field(default=(360.0, 45.0, 1.1), metadata=_rule(
        lambda v: all(x > 0 for x in v), "a list of numbers > 0"))
    link_latency_us: tuple[float, ...] = field(default=(3.0, 5.0, 30.0), metadata=_rule(
        lambda v: all(x >= 0 for x in v), "a list of numbers >= 0"))

    def __post_init__(self) -> None:
        if not len(self.link_names) == len(self.link_busbw_gbps) == len(self.link_latency_us):
            raise ConfigError(f"compare.link_names, compare.link_busbw_gbps and compare.link_latency_us have "
                              f"{len(self.link_names)}, {len(self.link_busbw_gbps)} and {len(self.link_latency_us)} "
                              "entries; allowed: one of each per link")


SECTIONS: dict[str, type] = {"workload": WorkloadConfig, "data": DataConfig, "commcheck": CommcheckConfig,
                             "train": TrainConfig,
                             "tracking": TrackingConfig, "evaluate": EvaluateConfig, "compare": CompareConfig}


@dataclass(frozen=True)
class Config:
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    data: DataConfig = DataConfig()
    commcheck: CommcheckConfig = CommcheckConfig()
    train: TrainConfig = TrainConfig()
    tracking: TrackingConfig = TrackingConfig()
    evaluate: EvaluateConfig = EvaluateConfig()
    compare: CompareConfig = CompareConfig()


def _type_ok(value: Any, hint: Any) -> bool:
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if hint is dict:
        return isinstance(value, dict)
    if typing.get_origin(hint) is tuple:
        (item,) = {a for a in typing.get_args(hint) if a is not Ellipsis}
        return isinstance(value, (list, tuple)) and all(_type_ok(v, item) for v in value)
    raise TypeError(f"no type check for {hint!r}")


# A number as people write it. YAML 1.1 (PyYAML) reads `1e-3` or `5e4` as strings: it wants a dot.
_NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")


def _as_number(value: Any, hint: Any) -> Any:
    """`value` as the float or int it spells when it is a string like '1e-3'; else unchanged."""
    if hint in (int, float) and isinstance(value, str) and _NUMBER.fullmatch(value.strip()):
        number = float(value)
        if hint is float:
            return number
        if number.is_integer():
            return int(number)
    return value


def _type_name(hint: Any) -> str:
    if typing.get_origin(hint) is tuple:
        return f"a list of {typing.get_args(hint)[0].__name__}"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string", dict: "a mapping"}[hint]


def _build_section(name: str, cls: type, raw: Any, source: str) -> Any:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: section '{name}' must be a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise ConfigError(
            f"{source}: unknown key '{name}.{unknown[0]}'; allowed keys in '{name}': "
            f"{', '.join(sorted(known))}"
        )
    values = {}
    for key, value in raw.items():
        hint = hints[key]
        value = _as_number(value, hint)
        if not _type_ok(value, hint):
            raise ConfigError(
                f"{source}: {name}.{key} = {value!r} has the wrong type; allowed: {_type_name(hint)}"
            )
        rule = known[key].metadata
        if rule and not rule["check"](value):
            raise ConfigError(f"{source}: {name}.{key} = {value!r} is not allowed; allowed: {rule['allowed']}")
        values[key] = tuple(value) if isinstance(value, list) else value
    try:
        return cls(**values)
    except ConfigError as exc:  # a rule across keys, raised by the dataclass itself
        raise ConfigError(f"{source}: {exc}") from None


def config_from_dict(raw: Any, source: str = "params.yaml") -> Config:
    """Validate a parsed params mapping; `source` names it in every error."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a mapping of sections, got {type(raw).__name__}")
    unknown = sorted(set(raw) - set(SECTIONS))
    if unknown:
        raise ConfigError(
            f"{source}: unknown section '{unknown[0]}'; allowed sections: {', '.join(SECTIONS)}"
        )
    return Config(**{name: _build_section(name, cls, raw.get(name), source) for name, cls in SECTIONS.items()})


def missing_keys(raw: dict) -> list[str]:
    """Every `section.key` the params mapping lacks: params.yaml holds every knob, so a gap means a
    truncated or half-edited file, not a wish for the default."""
    return [f"{name}.{f.name}" for name, cls in SECTIONS.items() for f in dataclasses.fields(cls)
            if not isinstance(raw.get(name), dict) or f.name not in raw[name]]


def load_config(path: str | Path = "params.yaml") -> Config:
    """Read and validate params.yaml, which must hold every knob; every stage takes its settings
    from here."""
    return read_config(path)[0]


def read_config(path: str | Path = "params.yaml") -> tuple[Config, str]:
    """load_config's settings, with the text they were read from (one read: a run records what
    it was configured with, even if the file changes under it)."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"{path}: not found; run from the project root or pass --params") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    if raw is None:
        raise ConfigError(f"{path}: empty; it must hold every section ({', '.join(SECTIONS)}): restore it "
                          "from git (git checkout -- params.yaml)")
    config = config_from_dict(raw, source=str(path))  # unknown keys and bad values first
    missing = missing_keys(raw)
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise ConfigError(f"{path}: missing key '{missing[0]}'{more} (a truncated file?); params.yaml must "
                          f"hold every knob: restore it from git or add the key")
    return config, text


def flatten(config: Config) -> dict[str, Any]:
    """`section.key -> value`, the form MLflow params and `dvc params diff` use."""
    flat = {}
    for section in dataclasses.fields(config):
        for key, value in dataclasses.asdict(getattr(config, section.name)).items():
            _flatten_into(flat, f"{section.name}.{key}", value)
    return flat


def _flatten_into(flat: dict[str, Any], name: str, value: Any) -> None:
    """A mapping (workload.init_args) as one key per leaf, as DVC names nested params
    (`workload.init_args.model`); an empty one stays, so that its key is there."""
    if isinstance(value, dict) and value:
        for key, item in value.items():
            _flatten_into(flat, f"{name}.{key}", item)
    else:
        flat[name] = list(value) if isinstance(value, tuple) else value
