"""speculators: train speculative-decoding drafters for a frozen target model and measure them.

See README.md for the two commands (`make demo`, `make test`), docs/ARCHITECTURE.md for the architecture
(docs/ALGORITHMS.md and docs/FORMATS.md: the specifications the code follows).
"""

__version__ = "0.1.0"
