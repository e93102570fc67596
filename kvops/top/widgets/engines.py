"""The engines panel: every engine the supervisor watches, and below the table the highlighted
engine's settings, or, while it has no snapshot, what it is waiting for (with a spinner). An engine
whose clients reach it through a gateway kvops runs is only as healthy as that gateway: while it is
down the row says so, in red, with the reason below."""

from __future__ import annotations

import time

from rich.markup import escape
from rich.text import Text
from textual.app import ComposeResult

from kvops.row_table import RowTable
from kvops.schema.snapshot import GpuStats, ProcessStats
from kvops.top.client import EngineView, TopState
from kvops.top.render import capacity, fmt_duration, fmt_pct, health
from kvops.top.widgets.common import Detail, Readout, TablePanel

SPINNER = "⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏"
GATEWAY_DOWN = "GATEWAY DOWN"


def gateway_down(view: EngineView) -> str:
    """Why the gateway kvops runs in front of the engine is not running ("" while it runs, or kvops runs none)."""
    link = view.entry.gateway
    if link is None or not link.managed or link.pid is not None or link.starts == 0:
        return ""
    how = link.stopped or (f"{link.last_exit}; restarting" if link.last_exit else "not running")
    last = f": {link.last_lines[-1]}" if link.last_lines else ""
    return f"gateway {how}{last}"


def row_health(view: EngineView) -> str:
    """The health column: the engine's, unless it is up and its gateway is not (its clients see the gateway)."""
    h = health(view)
    return GATEWAY_DOWN if h in ("up", "starting") and gateway_down(view) else h


class EnginesPanel(TablePanel):
    """`connecting`: what the panel says before the supervisor has answered once (an embedded
    supervisor being started, or the URL being tried)."""

    def __init__(self, connecting: str) -> None:
        super().__init__("engines", id="engines-panel")
        self.connecting = connecting
        self.state: TopState | None = None
        self.selected: str | None = None
        self.spin = 0

    def compose(self) -> ComposeResult:
        yield RowTable(id="engines")
        yield Readout(id="engine-info")

    def on_mount(self) -> None:
        self.query_one(RowTable).add_columns("engine", "health", "model", "restarts")
        self.show_info()
        # The spinner's timer belongs to the box it redraws, so it stops when the screen is torn
        # down instead of firing into a half-removed screen while the app exits.
        self.query_one("#engine-info").set_interval(0.25, self.tick)

    @property
    def view(self) -> EngineView | None:
        if self.state is None:
            return None
        return next((v for v in self.state.engines if v.entry.name == self.selected), None)

    def show_engines(self, state: TopState, selected: str | None) -> None:
        self.state, self.selected = state, selected
        rows = []
        for view in state.engines:
            h = row_health(view)
            style = "green" if h == "up" else "yellow" if h == "starting" else "bold red"
            model = view.latest.engine.model if view.latest else "-"
            rows.append((view.entry.name, (view.entry.name, Text(h, style=style), model, str(view.entry.restarts))))
        self.query_one(RowTable).fill(rows)
        self.show_info()

    def select(self, name: str | None) -> None:
        """The engine whose settings show below the table."""
        self.selected = name
        self.show_info()

    def tick(self) -> None:
        """Turn the spinner while something is starting."""
        view = self.view
        if self.state is None or (view is not None and view.latest is None):
            self.spin += 1
            self.show_info()

    def spinner(self) -> str:
        return SPINNER[self.spin % len(SPINNER)]

    def show_info(self) -> None:
        info = self.query_one("#engine-info", Readout)
        if self.state is None:
            info.show(Text(f"{self.spinner()} {self.connecting}…", style="yellow"))
            return
        view = self.view
        if view is None:
            info.show("no engines")
            return
        s = view.latest
        if s is None:
            info.show(self.waiting_text(view))
            return
        # Seven rows of about 38 columns (top.tcss) and capacity takes two: restarts and the request counts share
        # rows so the GPU line, last, still shows.
        gateway = view.entry.gateway
        # The block-size row gives way to the gateway's exit, which matters more (the clients cannot reach the engine);
        # the row is 38 columns, so the reason itself is in the detail.
        settings = (f"[bold red]gateway {escape(gateway.last_exit or 'down')}[/bold red]: enter says why"
                    if gateway is not None and gateway_down(view) else
                    f"block size {s.engine.block_size}  KV dtype {s.engine.kv_cache_dtype}")
        e = view.entry
        info.show(
            f"[b]{e.name}[/b] {row_health(view)}  pid {e.pid or '-'}  restarts {e.restarts}\n"
            f"model {s.engine.model}\n{settings}\n"
            f"capacity {capacity(s)}\n"
            f"uptime {fmt_duration(s.uptime_s)}  running {s.requests.running}  waiting {s.requests.waiting}\n"
            f"{gpu_compact(s.process)}")

    def waiting_text(self, view: EngineView) -> Text:
        """What an engine without a snapshot is waiting for: its process, /health, a restart."""
        e = view.entry
        now = time.time()
        text = Text()
        if down := gateway_down(view):
            text.append(f"{down}\n", style="bold red")
        if e.crash_loop:
            text.append(f"{e.name}: CRASH LOOP, not restarting\n", style="bold red")
            text.append(f"{e.last_error or ''}\nPOST /api/engines/{e.name}/resume restarts it")
            return text
        if e.restart_at is not None and e.pid is None:
            text.append(f"{self.spinner()} {e.name}: exited; restarting in {max(0.0, e.restart_at - now):.0f} s\n",
                        style="yellow")
        elif e.started_at is not None:
            text.append(f"{self.spinner()} {e.name}: starting (pid {e.pid}), {fmt_duration(now - e.started_at)}\n",
                        style="yellow")
            text.append(f"waiting for {e.url}/health\n")
        else:
            text.append(f"{self.spinner()} {e.name}: waiting for {e.url} to answer\n", style="yellow")
        if e.last_log:
            text.append(f"engine: {e.last_log[:200]}", style="dim")
        elif view.error or e.last_error:
            text.append(view.error or e.last_error or "", style="dim")
        return text

    def detail(self, key: str) -> Detail | None:
        view = next((v for v in self.state.engines if v.entry.name == key), None) if self.state else None
        return None if view is None else (f"engine {key}", engine_detail(view))


def _gib(value: int | None) -> str:
    return "?" if value is None else f"{value / 2**30:.1f}"


def _g(value: int | None) -> str:
    """Bytes in GiB in as few columns as tell them apart: 0.5G, 9.8G, 60G."""
    if value is None:
        return "?"
    gib = value / 2**30
    return f"{gib:.1f}G" if gib < 10 else f"{gib:.0f}G"


def _busy(gpu: GpuStats) -> str:
    return f"{gpu.utilization_percent:.0f}%" if gpu.utilization_known else "?%"


def gpu_compact(process: ProcessStats) -> str:
    """The engine's GPU(s) in the info box's width: utilization, then memory by kvops / others / free; or why
    there are none (the snapshot's gpu_status), never zeros. "?" marks what NVML did not give."""
    gpus = process.engine_gpus()
    if not gpus:
        return escape(f"gpu: {process.gpu_status}")
    return "; ".join(f"gpu{g.index} {_busy(g)} kvops {_g(g.memory_kvops_bytes)} other {_g(g.memory_others_bytes)} "
                     f"free {_g(g.free_bytes)}" for g in gpus)


def gpu_summary(process: ProcessStats) -> str:
    """The engine's GPU(s) in full words, for the detail view."""
    gpus = process.engine_gpus()
    if not gpus:
        return f"gpu: {process.gpu_status}"
    return "; ".join(f"gpu {g.index} {g.name}: {_busy(g)} busy, memory {_gib(g.memory_total_bytes)} GiB: kvops "
                     f"{_gib(g.memory_kvops_bytes)}, others {_gib(g.memory_others_bytes)}, free {_gib(g.free_bytes)}"
                     + (" (kvops: torch's reserved memory)" if g.memory_kvops_source == "torch" else "")
                     for g in gpus)


def engine_detail(view: EngineView) -> Text:
    e = view.entry
    text = Text()
    text.append(f"health {row_health(view)}  url {e.url}  pid {e.pid or '-'}  restarts {e.restarts}  "
                f"{'managed' if e.managed else 'watched'}\n")
    if e.last_error:
        text.append(f"last error: {e.last_error}\n", style="red")
    if gateway_down(view) and e.gateway is not None:
        text.append(f"{gateway_down(view)}\n", style="bold red")
        text.append("".join(f"  {line}\n" for line in e.gateway.last_lines), style="dim")
        text.append(f"its log: {e.gateway.log}; POST /api/engines/{e.name}/resume starts it again once fixed\n")
    s = view.latest
    if s is not None:
        def shown(path: str, value: object) -> str:  # "-" for what the source does not report, never a 0
            return str(value) if s.knows(path) else "-"

        hit_window = (f"{fmt_pct(s.prefix_cache.window_hit_rate)} in the last {s.prefix_cache.window_s:g} s"
                      if s.knows("prefix_cache.window_hit_rate") else f"no window of its own ({s.source})")
        swap = (f"{s.swap.preemption_mode}, host blocks {s.swap.host_blocks}, swapped {s.swap.swapped_blocks}"
                if s.knows("swap") else "-")
        cpu = f"{s.process.cpu_percent:.0f}%" if s.knows("process.cpu_percent") else "-"
        lines = [
            f"model {s.engine.model}  device {shown('engine.device', s.engine.device)}  "
            f"dtype {shown('engine.dtype', s.engine.dtype)}",
            f"block size {s.engine.block_size}  KV dtype {s.engine.kv_cache_dtype}  capacity {capacity(s)}",
            f"max model len {s.engine.max_model_len}  max seqs {shown('engine.max_num_seqs', s.engine.max_num_seqs)}  "
            f"batched tokens {shown('engine.max_num_batched_tokens', s.engine.max_num_batched_tokens)}",
            f"prefix caching {'on' if s.engine.enable_prefix_caching else 'off'}  eviction "
            f"{shown('engine.eviction_policy', s.engine.eviction_policy)}  "
            f"normalization {shown('prefix_cache.normalization', s.prefix_cache.normalization)}",
            f"requests finished {s.requests.finished_total}  aborted {s.requests.aborted_total}  "
            f"preemptions {s.requests.preemptions_total}",
            f"prefix hit rate {fmt_pct(s.prefix_cache.hit_rate)} overall, {hit_window}; "
            f"evictions {shown('prefix_cache.evictions_total', s.prefix_cache.evictions_total)}",
            f"swap: {swap}",
            f"process: cpu {cpu}  rss {s.process.rss_bytes / 2**20:.0f} MiB",
            gpu_summary(s.process),
        ]
        if s.unknown:
            lines.append(f"-: not reported by {s.source}")
        text.append("\n".join(lines))
    return text
