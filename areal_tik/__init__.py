"""areal-tik: one unified kernel set for AReaL rollout and training, bitwise identical."""
__version__ = "0.1.0"
