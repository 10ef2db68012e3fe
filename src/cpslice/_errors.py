"""The one error type of cpslice."""


class LayoutError(ValueError):
    """A layout, or a tensor given with a layout, breaks a rule of docs/layouts.md.

    The message names the sample (where there is one), the offending values and
    the rule, and where it can, what to pass instead.
    """
