"""The compile step of `parallelize()`: regional `torch.compile` of each block (regional.py)."""
