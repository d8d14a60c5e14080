"""One notebook open in JupyterLab, driven through Playwright (helpers of test_browser.py).

JupyterLab runs with ``expose_app_in_browser``, so the page's ``window.jupyterapp`` gives the
notebook's model (outputs, execution counts, kernel status) without depending on CSS class
names; the widgets themselves are found and moved the way a learner does, in the DOM.
"""
from __future__ import annotations

import json
import re
import time
from pathlib import Path

# JavaScript: the notebook panel of PATH, its code cells, and a mark on a cell's DOM node
_PANEL = """
const panel = Array.from(window.jupyterapp.shell.widgets('main'))
    .find(w => w.context && w.context.path === PATH);
const codeCells = panel ? panel.content.widgets.filter(c => c.model.type === 'code') : [];
"""
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
DARK, LIGHT = "JupyterLab Dark", "JupyterLab Light"
# JavaScript: text in the widgets of the output areas whose colour is too close to what is
# behind it. WCAG's contrast ratio, (L1 + 0.05) / (L2 + 0.05) of relative luminances; the
# background is its own or the first ancestor's that is not transparent; an SVG text's colour is its fill.
# Each widget output is scrolled to first: cells off screen are not laid out.
_CONTRAST = """
const parse = s => { const m = /rgba?\\(([^)]*)\\)/.exec(s || ''); if (!m) return null;
  const p = m[1].split(/[\\s,\\/]+/).filter(Boolean).map(Number);
  return [p[0], p[1], p[2], p.length > 3 ? p[3] : 1]; };
const lum = c => { const f = v => { v /= 255; return v <= 0.03928 ? v / 12.92 : Math.pow((v + 0.055) / 1.055, 2.4); };
  return 0.2126 * f(c[0]) + 0.7152 * f(c[1]) + 0.0722 * f(c[2]); };
const behind = el => { for (let e = el; e; e = e.parentElement) {
    const c = parse(getComputedStyle(e).backgroundColor); if (c && c[3] > 0.5) return c; }
  return [255, 255, 255, 1]; };
const frame = () => new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)));
const found = new Set();
for (const area of document.querySelectorAll('.jp-OutputArea-output')) {
  const roots = area.querySelectorAll('.jupyter-widgets');
  if (!roots.length) continue;
  area.scrollIntoView(); await frame();
  for (const root of roots) for (const el of root.querySelectorAll('*')) {
    const own = Array.from(el.childNodes).filter(n => n.nodeType === 3).map(n => n.textContent).join('').trim();
    if (!own) continue;
    const style = getComputedStyle(el), box = el.getBoundingClientRect();
    if (!box.width || !box.height || style.visibility === 'hidden' || Number(style.opacity) === 0) continue;
    const fg = parse(el instanceof SVGElement ? style.fill : style.color);
    if (!fg || fg[3] === 0) continue;
    const bg = behind(el);
    const mixed = fg.slice(0, 3).map((v, i) => fg[3] * v + (1 - fg[3]) * bg[i]);
    const [a, b] = [lum(mixed), lum(bg)];
    const ratio = (Math.max(a, b) + 0.05) / (Math.min(a, b) + 0.05);
    if (ratio < arg) found.add(`"${own.slice(0, 40)}": rgb(${mixed.map(Math.round)}) on rgb(${bg.slice(0, 3)}), ${ratio.toFixed(2)}:1`);
  }
}
return Array.from(found);
"""


class NotebookPage:
    """The notebook ``name`` (relative to the server's root) in ``page``."""

    def __init__(self, page, port: int, token: str, name: str):
        self.page, self.port, self.token, self.name = page, port, token, name

    def js(self, body: str, arg=None):
        """Run ``body`` (an async function body that may use ``panel``, ``codeCells``, ``arg``)."""
        script = f"async (arg) => {{ const PATH = {json.dumps(self.name)}; {_PANEL} {body} }}"
        return self.page.evaluate(script, arg)

    def wait_until(self, predicate, timeout: float, message: str, every: float = 0.25) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.name}: {message} (waited {timeout:.0f} s)")
            time.sleep(every)

    def kernel_state(self) -> str:
        return self.js("const k = panel && panel.sessionContext.session && "
                       "panel.sessionContext.session.kernel; return k ? k.status : 'none';")

    def open(self, timeout: float = 120) -> None:
        """Open the notebook in a workspace of its own and wait for an idle kernel."""
        workspace = "w" + "".join(ch for ch in self.name if ch.isalnum())[:40]
        self.page.goto(f"http://127.0.0.1:{self.port}/lab/workspaces/{workspace}/tree/{self.name}"
                       f"?reset&token={self.token}")
        self.page.wait_for_function("() => window.jupyterapp !== undefined", timeout=timeout * 1000)
        self.wait_until(lambda: self.js("return !!panel && panel.context.isReady;"), timeout,
                        "the notebook did not open")
        self.wait_until(lambda: self.kernel_state() == "idle", timeout, "the kernel never became idle")

    def run_all(self, timeout: float = 720) -> None:
        """Run All, then wait until no cell is queued or running and the kernel is idle."""
        self.js("window.jupyterapp.shell.activateById(panel.id);"
                "await window.jupyterapp.commands.execute('notebook:run-all-cells');")
        done = ("return window.jupyterapp.shell.currentWidget === panel && "
                "!Array.from(panel.node.querySelectorAll('.jp-InputPrompt'))"
                ".some(p => p.textContent.includes('*')) && "
                "panel.sessionContext.session.kernel.status === 'idle';")
        streak = 0

        def settled():
            nonlocal streak
            streak = streak + 1 if self.js(done) else 0
            return streak >= 4  # idle with nothing queued for a second

        self.wait_until(settled, timeout, "Run All did not finish")

    def sources(self) -> str:
        return self.js("return codeCells.map(c => c.model.sharedModel.getSource()).join('\\n');")

    def unexecuted_code_cells(self) -> int:
        return self.js("return codeCells.filter(c => c.model.executionCount === null).length;")

    def error_outputs(self) -> list[str]:
        """'ename: evalue' of every error output, with the first line of its cell.

        Read from the outputs' model: JupyterLab 4.6 renders a traceback as a
        ``.jp-RenderedText[data-mime-type="application/vnd.jupyter.stderr"]``, the same element
        as plain stderr, so the DOM cannot tell an error from a warning.
        """
        return self.js("""
            const found = [];
            for (const c of codeCells) {
              for (let i = 0; i < c.model.outputs.length; i++) {
                const o = c.model.outputs.get(i).toJSON();
                if (o.output_type === 'error')
                  found.push(`${o.ename}: ${o.evalue} (cell: ${c.model.sharedModel.getSource().split('\\n')[0]})\\n`
                             + (o.traceback || []).slice(-4).join('\\n').replace(/\\x1b\\[[0-9;]*m/g, ''));
              }
            }
            return found;""")

    def warning_outputs(self) -> list[str]:
        """Python warnings shown in stderr outputs ("...: UserWarning: ..." from the kernel or a
        rank), each with the first line of its cell. A cell that shows a warning on purpose says
        so with the tag ``shows-warning``."""
        return self.js("""
            const found = [];
            for (const c of codeCells) {
              const tags = c.model.getMetadata('tags') || [];
              if (tags.includes('shows-warning')) continue;
              for (let i = 0; i < c.model.outputs.length; i++) {
                const o = c.model.outputs.get(i).toJSON();
                if (o.output_type !== 'stream' || o.name !== 'stderr') continue;
                for (const line of String(o.text).split('\\n'))
                  if (/\\b[A-Za-z]*Warning: /.test(line))
                    found.push(`${line.trim()} (cell: ${c.model.sharedModel.getSource().split('\\n')[0]})`);
              }
            }
            return found;""")

    def broken_widgets(self, timeout: float = 30) -> list[str]:
        """Widget outputs not rendered as widget views within ``timeout`` seconds."""
        check = f"""
            const bad = [];
            codeCells.forEach((c, i) => {{
              const views = [];
              for (let j = 0; j < c.model.outputs.length; j++)
                if ({json.dumps(WIDGET_MIME)} in c.model.outputs.get(j).data) views.push(j);
              if (!views.length) return;
              const text = c.node.querySelector(".jp-Cell-outputArea").innerText;
              if (text.includes('Loading widget') || text.includes('Error displaying widget'))
                bad.push(`code cell ${{i}}: ${{text.slice(0, 200)}}`);
              else if (c.node.querySelectorAll('.jp-OutputArea-output .jupyter-widgets').length === 0)
                bad.push(`code cell ${{i}}: no widget view in the DOM`);
            }});
            return bad;"""
        deadline = time.monotonic() + timeout
        while (bad := self.js(check)) and time.monotonic() < deadline:
            time.sleep(0.5)
        return bad

    def cell(self, marker: str):
        """A locator for the output area of the first code cell whose source contains ``marker``."""
        key = "".join(ch for ch in marker if ch.isalnum())
        found = self.js("""
            const c = codeCells.find(c => c.model.sharedModel.getSource().includes(arg.marker));
            if (!c) return false;
            c.node.setAttribute('data-test-cell', arg.key);
            return true;""", {"marker": marker, "key": key})
        assert found, f"{self.name}: no code cell contains {marker!r}"
        return self.page.locator(f'[data-test-cell="{key}"] .jp-Cell-outputArea')

    def widget_text(self, marker: str) -> str:
        """The text under the cell with ``marker``, scrolled to first: a cell far from the view
        is not laid out (content-visibility), and its text then reads as empty."""
        area = self.cell(marker)
        if not area.inner_text():
            area.scroll_into_view_if_needed()
            self.page.wait_for_timeout(300)  # laid out on the next frames
        return area.inner_text()

    def image_bytes(self, marker: str) -> bytes:
        """The bytes of the last image shown under the cell with ``marker`` (b'' if none)."""
        self.cell(marker)
        key = "".join(ch for ch in marker if ch.isalnum())
        data = self.page.evaluate("""async (key) => {
            const imgs = document.querySelectorAll(`[data-test-cell="${key}"] .jp-Cell-outputArea img`);
            if (!imgs.length || !imgs[imgs.length - 1].src) return [];
            const buf = await (await fetch(imgs[imgs.length - 1].src)).arrayBuffer();
            return Array.from(new Uint8Array(buf));}""", key)
        return bytes(data)

    def move_slider(self, marker: str, presses: int = 2) -> None:
        """Focus the first slider under ``marker`` and press the right arrow ``presses`` times."""
        handle = self.cell(marker).locator(".widget-slider .noUi-handle").first
        handle.click()
        for _ in range(presses):
            handle.press("ArrowRight")

    def click_button(self, marker: str, description: str) -> None:
        """Click the button labelled exactly ``description`` under the cell with ``marker``
        (by its text: an icon's glyph is part of the button's accessible name)."""
        exact = re.compile(rf"^\s*{re.escape(description)}\s*$")
        self.cell(marker).locator("button").filter(has_text=exact).click()

    def image_widths(self, marker: str) -> tuple[int, int, int]:
        """(natural, shown, room) width in pixels of the last image under the cell with
        ``marker``; room: the output area's width, from the image's left edge."""
        self.cell(marker)
        key = "".join(ch for ch in marker if ch.isalnum())
        return tuple(self.page.evaluate("""(key) => {
            const imgs = document.querySelectorAll(`[data-test-cell="${key}"] .jp-Cell-outputArea img`);
            const img = imgs[imgs.length - 1];
            if (!img) return [0, 0, 0];
            const box = img.getBoundingClientRect();
            const area = img.closest('.jp-OutputArea-output').getBoundingClientRect();
            return [img.naturalWidth, Math.round(box.width), Math.round(area.right - box.left)];}""", key))

    def select_option(self, marker: str, description: str, label: str) -> None:
        box = self.cell(marker).locator(".widget-dropdown").filter(
            has=self.page.locator(f'label:text-is("{description}")'))
        box.locator("select").select_option(label=label)

    def fill_number(self, marker: str, description: str, value: str) -> None:
        box = self.cell(marker).locator(".widget-text").filter(
            has=self.page.locator(f'label:text-is("{description}")'))
        field = box.locator("input")
        field.fill(value)
        field.press("Enter")

    def stderr_lines(self) -> dict[int, int]:
        """Code cell index -> lines of stderr output it shows (stderr is not an error)."""
        return {int(k): v for k, v in self.js("""
            const lines = {};
            codeCells.forEach((c, i) => {
              for (let j = 0; j < c.model.outputs.length; j++) {
                const o = c.model.outputs.get(j).toJSON();
                if (o.output_type === 'stream' && o.name === 'stderr')
                  lines[i] = (lines[i] || 0) + String(o.text).split('\\n').length - 1;
              }
            });
            return lines;""").items()}

    def screenshot_widgets(self, prefix: Path) -> list[Path]:
        """Screenshots of the output areas that hold widgets or stderr, as ``prefix-<cell>.png``."""
        indices = self.js(f"""
            const keep = [];
            codeCells.forEach((c, i) => {{
              for (let j = 0; j < c.model.outputs.length; j++) {{
                const o = c.model.outputs.get(j);
                if ({json.dumps(WIDGET_MIME)} in o.data || o.toJSON().name === 'stderr') {{
                  c.node.setAttribute('data-test-shot', String(i)); keep.push(i); break;
                }}
              }}
            }});
            return keep;""")
        paths = []
        for i in indices:
            path = Path(f"{prefix}-cell{i:03d}.png")
            self.screenshot(self.page.locator(f'[data-test-shot="{i}"] .jp-Cell-outputArea'), path)
            paths.append(path)
        return paths

    def screenshot(self, locator, path: Path) -> None:
        """A screenshot of ``locator`` once it has stopped moving: cells off screen are laid out
        only when scrolled to (content-visibility), which moves the cells below them."""
        for _ in range(3):
            locator.scroll_into_view_if_needed()
            self.page.wait_for_timeout(300)
        locator.screenshot(path=str(path))

    def set_theme(self, theme: str, timeout: float = 30) -> None:
        """Switch JupyterLab to ``theme`` (``DARK`` or ``LIGHT``) as a learner does (Settings >
        Theme), and wait until the page has it."""
        self.js("await window.jupyterapp.commands.execute('apputils:change-theme', {theme: arg});", theme)
        light = "false" if theme == DARK else "true"
        self.wait_until(lambda: self.page.evaluate("() => document.body.dataset.jpThemeLight") == light
                        and self.page.evaluate("() => document.body.dataset.jpThemeName") == theme,
                        timeout, f"JupyterLab did not switch to {theme}")
        self.page.wait_for_timeout(500)  # the theme's CSS applied

    def low_contrast_text(self, minimum: float = 3.0) -> list[str]:
        """Text in the widgets whose contrast with what is behind it is under ``minimum``:1
        (WCAG asks 4.5 for body text and 3 for large text; black on a dark theme's background
        is about 1.1). Each as '"text": its colour on the background, ratio'."""
        return self.js(_CONTRAST, minimum)

    def shutdown_kernel(self) -> None:
        try:
            self.js("if (panel) await panel.sessionContext.shutdown();")
        except Exception:  # noqa: BLE001 -- the server's shutdown stops the kernel anyway
            pass
