"""What a layer declares its ``RELAY_*`` environment variables with (beside its code): a
:class:`Layer` of :class:`Variable` s, and the parsers of their values (each takes the
variable's name and its text, and raises ValueError naming the variable)."""

from ._settings import Layer, Variable, flag_off, flag_on, integer, seconds, text, threads_from

__all__ = ["Layer", "Variable", "flag_off", "flag_on", "integer", "seconds", "text", "threads_from"]
