"""speculators: train speculative-decoding drafters for a frozen target model and measure them.

See README.md for the two commands (`make demo`, `make test`), DESIGN.md for the architecture.
"""

__version__ = "0.1.0"
