"""Moved to :mod:`spmdcomm.parallel.data.layout`: a shim that warns, until the next release."""

from spmdcomm._moved import moved

__all__, __getattr__ = moved(__name__, "spmdcomm.parallel.data.layout")
