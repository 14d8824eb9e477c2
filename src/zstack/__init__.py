"""zstack: the `z` command line over the zstack packages.

No library logic lives here: the CLI only wires user input to zcore, zoffload,
zcomm, zquant, zmoe, zserve, zchat, ztrain and znative, and to the scripts in `benchmarks/`.
"""

__version__ = "0.1.0"
