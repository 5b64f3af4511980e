"""The paper's experiments as runnable code: Table 3's model variations (§6.2) and Table 1's
per-layer costs (§4). The commands live in :mod:`aiayn.cli.experiment`."""
