"""Model making: the real target's conversion and its draft, the toy pair, the EAGLE head."""
