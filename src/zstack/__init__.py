"""zstack: the `z` command line and end-to-end recipes over the zstack packages.

No library logic lives here: the CLI only wires user input to zcore, zoffload,
zcomm, zquant, zmoe, zserve and znative, and to the scripts in `benchmarks/`.
"""

__version__ = "0.1.0"
