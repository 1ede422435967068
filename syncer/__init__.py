"""The yeto syncer: the outer loop of a DiLoCo run (`python -m syncer --help`)."""
