"""embedq's version, at the bottom of the layers: any module may say which embedq it is without importing the
package's ``__init__`` (which reaches up to the producer API)."""

__version__ = "0.1.0"
