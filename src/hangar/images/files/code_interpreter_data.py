"""A pandas DataFrame as data, run inside a code-interpreter guest's Python kernels (not on
the host).

The code interpreter's server (``code_interpreter_jupyter.py``) runs ``install(get_ipython())``
in every Python kernel: it adds a display formatter whose output, MIME type ``MIME``, the
server sends as the result's ``data`` (beside the frame's text and HTML), the shape E2B's
SDKs parse as ``Result.data`` and E2B's own kernel gives: the frame's columns by name, each
the list of its values (``DataFrame.to_dict(orient="list")``), timestamps as ISO 8601 text,
NaN as ``nan``. Objects of other types get a ``data`` only through a ``_repr_e2b_data_`` method of their own,
as in E2B's kernel. A frame whose values JSON cannot carry gets no ``data``: the formatter
never fails a cell.
"""

from __future__ import annotations

import json
import math
import sys
from typing import Any

MIME = "application/vnd.hangar.data+json"


def _value(value: Any, timestamp: type) -> Any:
    """One value as JSON carries it: a pandas ``timestamp`` as ISO 8601 text, a NaN or
    infinite float as its text (``nan``, ``inf``: what Jupyter's messages make of it in
    E2B's kernel); raises ``ValueError`` for a value JSON cannot carry."""
    if isinstance(value, timestamp):
        return value.isoformat()
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if not (isinstance(value, (str, int, float)) or value is None):
        json.dumps(value, allow_nan=False)   # a list or dict of plain values passes
    return value


def data_of(frame: Any) -> dict[str, list[Any]] | None:
    """``frame``'s columns as ``{name: [values]}`` (names as text); None when a value is not
    one JSON carries (a ``Timedelta``, an object), or two names are the same text."""
    import pandas

    columns = frame.to_dict(orient="list")
    try:
        out = {str(name): [_value(v, pandas.Timestamp) for v in values]
               for name, values in columns.items()}
    except (TypeError, ValueError):
        return None
    return out if len(out) == len(columns) else None


def install(ip: Any) -> None:
    """Add the data formatter to IPython shell ``ip`` (once)."""
    if ip is None or MIME in ip.display_formatter.formatters:
        return

    from IPython.core.formatters import BaseFormatter
    from traitlets import ObjectName, Unicode

    class DataFormatter(BaseFormatter):  # type: ignore[misc]
        format_type = Unicode(MIME)
        _return_type = (dict, str)
        print_method = ObjectName("_repr_e2b_data_")

        def __call__(self, obj: Any) -> Any:
            # pandas is looked up, not imported: a frame exists only once the cell imported it
            pandas = sys.modules.get("pandas")
            if pandas is None or not isinstance(obj, pandas.DataFrame):
                return super().__call__(obj)
            try:
                return data_of(obj)
            except Exception:  # noqa: BLE001 - the frame keeps its text and HTML
                return None

    ip.display_formatter.formatters[MIME] = DataFormatter(parent=ip.display_formatter)
