"""`python -m pipeline`: the CLI under the name DESIGN.md fixes. The commands live in stages/ (the
only place pipeline/ reaches into it: an entry point, imported by nothing)."""

from stages.entry import main

main()
