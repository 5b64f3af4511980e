"""English constituency parsing as translation (§6.3): Penn Treebank reading and splitting,
Vinyals & Kaiser et al. (2014) linearization, constrained decoding into well-formed trees, and
EVALB-compatible scoring. The command is :mod:`aiayn.cli.parse`."""
