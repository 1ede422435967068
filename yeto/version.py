"""yeto's version number, `yeto.__version__` (what `provenance.json` records when the
package is not installed)."""

__version__ = "0.1.0"
