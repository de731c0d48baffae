"""hasten: GRPO and RFT training that is measurably fast on the hardware you have.

The package imports nothing heavy at the top level so that `hasten --help`
stays fast; import the parts you need (hasten.config, hasten.train.trainer, ...).
"""

__version__ = "0.1.0"
