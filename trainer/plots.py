"""Line charts as inline SVG, drawn on the server: the job pages load no script or CDN."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from django.utils.html import escape, format_html
from django.utils.safestring import SafeString, mark_safe

COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e")


@dataclass
class Series:
    name: str
    points: Sequence[tuple[float, float]]


def line_chart(series: Sequence[Series], *, title: str, width: int = 460, height: int = 220,
               y_min: float | None = None, y_max: float | None = None) -> SafeString:
    pad_l, pad_r, pad_t, pad_b = 44, 10, 24, 28
    points = [p for s in series for p in s.points]
    if not points:
        return format_html('<div class="chart empty">{}: no data yet</div>', title)
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    x0, x1 = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1
    lo = min(ys) if y_min is None else y_min
    hi = max(ys) if y_max is None else y_max
    hi = hi if hi > lo else lo + 1

    def sx(x: float) -> float:
        return pad_l + (x - x0) / (x1 - x0) * (width - pad_l - pad_r)

    def sy(y: float) -> float:
        return height - pad_b - (y - lo) / (hi - lo) * (height - pad_t - pad_b)

    parts = [
        f'<svg class="chart" role="img" aria-label="{escape(title)}" width="{width}" '
        f'height="{height}" viewBox="0 0 {width} {height}" xmlns="http://www.w3.org/2000/svg">',
        f'<text x="{pad_l}" y="15" font-size="13" font-weight="bold">{escape(title)}</text>',
        f'<line x1="{pad_l}" y1="{height - pad_b}" x2="{width - pad_r}" y2="{height - pad_b}" '
        'stroke="#999"/>',
        f'<line x1="{pad_l}" y1="{pad_t}" x2="{pad_l}" y2="{height - pad_b}" stroke="#999"/>',
    ]
    for value in (lo, (lo + hi) / 2, hi):
        parts.append(f'<text x="{pad_l - 4}" y="{sy(value) + 4:.1f}" font-size="10" '
                     f'text-anchor="end">{value:.3g}</text>')
    parts.append(f'<text x="{pad_l}" y="{height - 8}" font-size="10">step {x0:g}</text>')
    parts.append(f'<text x="{width - pad_r}" y="{height - 8}" font-size="10" '
                 f'text-anchor="end">step {x1:g}</text>')
    for index, s in enumerate(series):
        color = COLORS[index % len(COLORS)]
        coords = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in s.points)
        if len(s.points) > 1:
            parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="2" '
                         f'points="{coords}"/>')
        for x, y in s.points:
            parts.append(f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="2.5" fill="{color}">'
                         f'<title>{escape(s.name)} step {x:g}: {y:.4g}</title></circle>')
        # Legend on the title row, right to left, clear of the plotted lines.
        parts.append(f'<text x="{width - pad_r - 80 * index}" y="15" font-size="11" '
                     f'text-anchor="end" fill="{color}">{escape(s.name)}</text>')
    parts.append("</svg>")
    return mark_safe("".join(parts))  # every interpolated text above is escaped
