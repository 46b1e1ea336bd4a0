"""Structured charts: a matplotlib figure described as data, run inside a code-interpreter
guest's Python kernels (not on the host).

The code interpreter's server (``code_interpreter.py``) runs ``install(get_ipython())`` in
every Python kernel: it adds a display formatter for matplotlib figures whose output, MIME
type ``MIME``, the server sends as the result's ``chart`` (beside the PNG). The shape is the
one E2B's SDKs parse (``e2b_code_interpreter.charts``): ``type`` (``line``, ``scatter``,
``bar``, ``pie``, ``box_and_whisker``, ``superchart`` for a figure of several axes,
``unknown``), ``title``, ``elements``, and for the 2D types ``x_label``/``y_label``,
``x_unit``/``y_unit`` (the label's last parenthesised part); line and scatter charts add
``x_ticks``, ``x_tick_labels``, ``x_scale`` and the same of y (``linear``, ``log``,
``datetime``, ``categorical``, ...). Points of a date axis are ISO 8601 strings. A figure that
cannot be described is left without a chart (the formatter never fails a cell).
"""

from __future__ import annotations

import datetime
import re
from typing import Any

MIME = "application/vnd.hangar.chart+json"
UNIT = re.compile(r"[(\[]([^()\[\]]+)[)\]]\s*$")


def _unit(label: str | None) -> str | None:
    found = UNIT.search(label or "")
    return found.group(1).strip() if found else None


def _text(value: str | None) -> str | None:
    return value or None


def _kind(axis: Any) -> str:
    """The scale of an axis: matplotlib's name, or ``datetime``/``categorical`` by its
    converter."""
    import matplotlib.category
    import matplotlib.dates

    converter = axis.get_converter() if hasattr(axis, "get_converter") else axis.converter
    if isinstance(converter, matplotlib.category.StrCategoryConverter):
        return "categorical"
    dates = tuple(c for c in (getattr(matplotlib.dates, "DateConverter", None),
                              getattr(matplotlib.dates, "_SwitchableDateConverter", None)) if c)
    if isinstance(converter, dates) or isinstance(
            axis.get_major_formatter(), (matplotlib.dates.AutoDateFormatter,
                                         matplotlib.dates.ConciseDateFormatter,
                                         matplotlib.dates.DateFormatter)):
        return "datetime"
    return axis.get_scale()


def _value(v: Any, kind: str) -> Any:
    """A point's coordinate as JSON: a date axis's as ISO 8601, a category's as its text,
    a number as a float."""
    import matplotlib.dates

    if isinstance(v, (datetime.datetime, datetime.date)):
        return v.isoformat()
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, (datetime.datetime, datetime.date)):
        return v.isoformat()
    if isinstance(v, str):
        return v
    if kind == "datetime":
        return matplotlib.dates.num2date(float(v)).isoformat()
    return float(v)


def _ticks(axis: Any, kind: str) -> tuple[list[Any], list[str]]:
    ticks = [_value(t, kind) if kind == "datetime" else float(t)
             for t in axis.get_ticklocs()]
    return ticks, [t.get_text() for t in axis.get_ticklabels()]


def _base(ax: Any) -> dict[str, Any]:
    x_label, y_label = _text(ax.get_xlabel()), _text(ax.get_ylabel())
    return {"title": _text(ax.get_title()), "x_label": x_label, "y_label": y_label,
            "x_unit": _unit(x_label), "y_unit": _unit(y_label)}


def _points(ax: Any, kind: str, elements: list[dict[str, Any]]) -> dict[str, Any]:
    x_kind, y_kind = _kind(ax.xaxis), _kind(ax.yaxis)
    x_ticks, x_labels = _ticks(ax.xaxis, x_kind)
    y_ticks, y_labels = _ticks(ax.yaxis, y_kind)
    return {"type": kind, **_base(ax), "x_scale": x_kind, "y_scale": y_kind,
            "x_ticks": x_ticks, "x_tick_labels": x_labels, "y_ticks": y_ticks,
            "y_tick_labels": y_labels, "elements": elements}


def _label_at(ax: Any, x: float) -> str:
    """The x tick label nearest ``x`` (a bar's category)."""
    locs = list(ax.xaxis.get_ticklocs())
    labels = [t.get_text() for t in ax.xaxis.get_ticklabels()]
    units = getattr(ax.xaxis, "units", None)
    mapping = getattr(units, "_mapping", None)
    if mapping:
        for name, at in mapping.items():
            if abs(at - x) < 0.5:
                return str(name)
    if locs and len(labels) == len(locs):
        i = min(range(len(locs)), key=lambda j: abs(locs[j] - x))
        return labels[i]
    return str(x)


def _bar(ax: Any) -> dict[str, Any] | None:
    from matplotlib.container import BarContainer

    bars = [c for c in ax.containers if isinstance(c, BarContainer)]
    if not bars:
        return None
    elements = []
    for container in bars:
        group = container.get_label()
        for rect in container.patches:
            value = rect.get_height()
            elements.append({"label": _label_at(ax, rect.get_x() + rect.get_width() / 2),
                             "group": group if group and not group.startswith("_") else "",
                             "value": float(value)})
    return {"type": "bar", **_base(ax), "elements": elements}


def _pie(ax: Any) -> dict[str, Any] | None:
    from matplotlib.patches import Wedge

    wedges = [p for p in ax.patches if isinstance(p, Wedge)]
    if not wedges or len(wedges) != len(ax.patches):
        return None
    return {"type": "pie", "title": _text(ax.get_title()),
            "elements": [{"label": w.get_label(), "angle": _degrees(w.theta2 - w.theta1),
                          "radius": float(w.r)} for w in wedges]}


ANGLE_DIGITS = 3
"""Decimals a wedge's angle keeps (degrees): matplotlib 3.6 (Debian bookworm's) computes
wedge angles in single precision, so a 90 % wedge spans 323.999991 degrees."""


def _degrees(angle: float) -> float:
    return round(float(angle), ANGLE_DIGITS)


def _box(ax: Any) -> dict[str, Any] | None:
    """A box plot: per box, matplotlib adds 2 whiskers, 2 caps, the box (a line, or a
    patch with ``patch_artist``), the median and the fliers, in that order."""
    from matplotlib.patches import PathPatch

    lines = list(ax.lines)
    patches = [p for p in ax.patches if isinstance(p, PathPatch)]
    per = 6 if patches else 7
    n = len(patches) if patches else len(lines) // 7
    if n == 0 or len(lines) != per * n or (patches and len(patches) != len(ax.patches)):
        return None
    elements = []
    for i in range(n):
        lo, hi, _cap1, _cap2, *rest = lines[i * per:(i + 1) * per]
        median, fliers = rest[-2], rest[-1]
        if patches:
            ys = patches[i].get_path().vertices[:, 1]
            q1, q3 = float(min(ys)), float(max(ys))
        else:
            ys = rest[0].get_ydata()
            q1, q3 = float(min(ys)), float(max(ys))
        x = float(sum(median.get_xdata()) / len(median.get_xdata()))
        elements.append({"label": _label_at(ax, x), "min": float(lo.get_ydata()[1]),
                         "first_quartile": q1, "median": float(median.get_ydata()[0]),
                         "third_quartile": q3, "max": float(hi.get_ydata()[1]),
                         "outliers": [float(v) for v in fliers.get_ydata()]})
    return {"type": "box_and_whisker", **_base(ax), "elements": elements}


def _axes_chart(ax: Any) -> dict[str, Any]:
    from matplotlib.collections import PathCollection

    for describe in (_pie, _box, _bar):
        chart = describe(ax)
        if chart is not None:
            return chart
    scatters = [c for c in ax.collections if isinstance(c, PathCollection)]
    if scatters and not ax.lines:
        kind = _kind(ax.xaxis), _kind(ax.yaxis)
        return _points(ax, "scatter", [
            {"label": c.get_label(),
             "points": [[_value(x, kind[0]), _value(y, kind[1])] for x, y in c.get_offsets()]}
            for c in scatters])
    if ax.lines and not scatters:
        kind = _kind(ax.xaxis), _kind(ax.yaxis)
        return _points(ax, "line", [
            {"label": line.get_label(),
             "points": [[_value(x, kind[0]), _value(y, kind[1])]
                        for x, y in zip(line.get_xdata(), line.get_ydata())]}
            for line in ax.lines])
    return {"type": "unknown", "title": _text(ax.get_title()), "elements": []}


def chart_of(fig: Any) -> dict[str, Any] | None:
    """The chart of a matplotlib figure (None when it has no axes or cannot be read)."""
    try:
        axes = [ax for ax in fig.get_axes() if ax.get_visible()]
        if not axes:
            return None
        if len(axes) == 1:
            return _axes_chart(axes[0])
        title = fig._suptitle.get_text() if getattr(fig, "_suptitle", None) else None
        return {"type": "superchart", "title": title or None,
                "elements": [_axes_chart(ax) for ax in axes]}
    except Exception:  # a figure this cannot describe: the PNG alone
        return None


def install(ip: Any) -> None:
    """Add the chart formatter to IPython shell ``ip`` (once). It answers for figures itself
    rather than through the formatter's type registry, which matplotlib's inline backend
    empties of figures when it is set up."""
    if ip is None or MIME in ip.display_formatter.formatters:
        return
    import sys

    from IPython.core.formatters import BaseFormatter
    from traitlets import ObjectName, Unicode

    class ChartFormatter(BaseFormatter):  # type: ignore[misc]
        format_type = Unicode(MIME)
        _return_type = dict
        print_method = ObjectName("_repr_hangar_chart_")

        def __call__(self, obj: Any) -> dict[str, Any] | None:
            figure = sys.modules.get("matplotlib.figure")
            if figure is None or not isinstance(obj, figure.Figure):
                return None
            return chart_of(obj)

    ip.display_formatter.formatters[MIME] = ChartFormatter(parent=ip.display_formatter)
