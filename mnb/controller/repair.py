"""Self-repair: the pool's one owner of its generations, the relaunch thread and the broken state.

Every way the pool's processes change goes through :class:`Repair`:

- ``launch`` (``Pool.start``/``restart``): a new generation, in the caller's thread; a restart's
  in the pool's layout, restored as an automatic restart restores it (one path: ``_adopt_in``);
- ``after(outcome)``, the one entry point after each request's outcome, and
  ``replace(why)``: ranks died or cannot be released, so every process is
  replaced in the background with the same size, device and layout (one line
  says so; the layout it promises is the one the new ranks get, restored on the
  new generation before the pool adopts it);
- ``stop``: from then on nothing relaunches; a relaunch under way is cancelled
  and joined (a late failure of a request that was running cannot start torchrun again);
- ``adopt``: a built generation becomes the pool's in one assignment;
- standby ranks (``standby.py``): with ``standby_on``, a new standby is prepared after each
  adoption (launched once the adopted ranks finished their start, ``ranks_started``), and ``launch`` and the relaunch thread adopt a matching live one instead of
  launching cold (a mismatched one is discarded, a dead one replaced; ``start_note`` says which).

The relaunch thread reads only the inbox of the generation it builds, never the
pool's current one, so ``status`` during a restart cannot take its hellos; it
answers from the restart's own progress (:meth:`Repair.rows`).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

from mnb.config import ParallelConfig
from mnb.controller.collector import Outcome
from mnb.controller.generation import Generation, RankInfo, launch
from mnb.controller.guards import InterruptLatch
from mnb.controller.launcher import LaunchSpec, Launcher
from mnb.controller.output import coords_label
from mnb.controller.reports import death_lines, last_words
from mnb.controller.standby import Standby, difference, settings
from mnb.controller.transport import Transport
from mnb.errors import LayoutRefused, PoolError, interrupted
from mnb.protocol import Message
from mnb.timeouts import ASK_TIMEOUT_S, DEATH_REPORT_WAIT_S, DEFAULT_GRACE_S

log = logging.getLogger(__name__)

STOPPED = "the pool was stopped"
STOPPED_NEXT = ("a stopped pool is never relaunched: start a new one with %mnb start "
                "(or mnb.controller.Pool.start())")
"""What to do with a stopped pool: every refusal of one says it (``wait``, ``Pool.restart``)."""


def layout_kept(layout: ParallelConfig) -> str:
    """What every restart (automatic, ``%mnb restart``, ``--isolated``) says it kept and lost."""
    return f"names defined in earlier cells are gone, the layout {layout.describe()} stays"


class Repair:
    """The pool's current generation and everything that replaces or ends it."""

    def __init__(self, spec: LaunchSpec, *, bind_ip: str, start_timeout_s: float,
                 make_launcher: Callable[[LaunchSpec], Launcher], standby_on: bool = False):
        self.spec = spec
        self.bind_ip = bind_ip
        self.start_timeout_s = start_timeout_s
        self.make_launcher = make_launcher
        self.generation: Generation | None = None
        """The ranks requests go to (replaced in one assignment, never changed in size)."""
        self.broken: str | None = None
        """Why requests are refused until ``%mnb restart`` (a failed restart, a multi-host pool's death, a stop)."""
        self.stopped = False
        self.restarts = 0
        """How many times the pool replaced its processes on its own."""
        self._lock = threading.Lock()  # state changes only; never held over a wait
        self._thread: threading.Thread | None = None
        self._cancel = threading.Event()
        self._building: Launcher | None = None
        self._restore_latch = InterruptLatch()
        self._progress: dict[int, dict[str, Any]] | None = None  # replaced, never changed in place
        self.standby_on = standby_on
        self.standby: Standby | None = None
        """The next generation, launched ahead and waiting for ``go`` (``standby_on``)."""
        self.start_note = ""
        """What the last start or restart did about a standby ("adopted the standby ...", "launched cold ...")."""
        self.restart_line = ""
        """The automatic restart's result, said once by the next request (``wait``)."""
        self.replaced_why = ""
        """Why the last generation was replaced (``%mnb debug`` says it when the frames it wants are gone)."""

    # ------------------------------------------------------------ in the caller's thread
    def launch(self, layout: ParallelConfig | None = None) -> Generation:
        """A new generation for ``Pool.start``/``restart``, put in ``layout`` (None: the default, as the
        ranks start) and adopted before it returns."""
        with self._lock:
            self.stopped, self.broken = False, None
            self._cancel.clear()
            self._restore_latch = InterruptLatch()  # a stop cancelled the last one
            if self.generation is not None:
                self.replaced_why = "the pool was restarted (%mnb restart)"
        self._adopt_in(self._build(), layout)
        self.prepare_standby()
        return self.generation

    def _build(self, on_launched: Callable[[Launcher], None] = lambda launcher: None,
               on_hello: Callable[[RankInfo], None] = lambda info: None) -> Generation:
        """The next generation: the standby when it matches and lives, else a cold launch."""
        standby, self.standby = self.standby, None
        note = "launched cold, no standby yet" if self.standby_on else "launched cold, standby off"
        if standby is not None:
            changed = difference(standby.settings, settings(self.spec, self.bind_ip))
            if changed:
                standby.close()
                note = f"launched cold: discarded the standby, its settings no longer match ({changed})"
            elif not self.standby_on:
                standby.close()
                note = "launched cold: discarded the standby (standby off)"
            elif not standby.alive():
                state = standby.status()["state"]
                standby.close()
                note = f"launched cold: the standby had ended on its own ({state}), so it was replaced"
            else:
                on_launched(standby.launcher)
                try:
                    generation = standby.adopt(self.start_timeout_s, self._cancel, on_hello)
                except PoolError as exc:
                    if self._cancel.is_set():
                        raise
                    note = f"launched cold: {exc}"
                else:
                    # a standby adopted mid-import saves only what it had done: the line says so, or the
                    # seconds read as the standby's (docs: 0.3 s) when they were mostly its imports
                    self.start_note = "adopted the standby" + (
                        f" (it was still importing: waited {standby.waited_s:.1f} s for it)"
                        if standby.waited_s >= 1 else "")
                    return generation
        self.start_note = note
        return launch(self.spec, self.make_launcher, bind_ip=self.bind_ip, timeout_s=self.start_timeout_s,
                      cancelled=self._cancel, on_launched=on_launched, on_hello=on_hello)

    def prepare_standby(self) -> None:
        """Launch the next generation in the background (``standby_on``; one at a time)."""
        with self._lock:
            if not self.standby_on or self.stopped or (self.standby is not None and self.standby.alive()):
                return
            old, self.standby = self.standby, Standby(self.spec, self.bind_ip, self.make_launcher,
                                                      self.start_timeout_s, not_before=self.ranks_started)
        if old is not None:
            old.close()  # died on its own: replaced

    def ranks_started(self) -> bool:
        """Whether no rank of the current generation still finishes its start after its hello (Megatron-Core's
        import, ``mnb/worker/late_start.py``): asked of the ranks (their I/O threads answer ``status``);
        True without a generation or answer (nothing to wait for)."""
        generation = self.generation
        if generation is None or generation.closed:
            return True
        try:
            answers = generation.transport.ask("status", sorted(generation.ranks), ASK_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - closed meanwhile: nothing to wait for
            return True
        return not any(answer.get("starting") for answer in answers.values())

    def take_standby(self) -> Standby | None:
        """The standby, now the caller's (``Pool.stop`` parks it for the next start in this kernel)."""
        with self._lock:
            standby, self.standby = self.standby, None
        return standby

    def adopt(self, generation: Generation) -> None:
        """Make ``generation`` the pool's (a stopped pool closes it instead and raises)."""
        with self._lock:
            refused = self.stopped or self._cancel.is_set()
            if not refused:
                self.generation, self.broken, self._progress = generation, None, None
        if refused:
            generation.close(grace_s=0)
            raise PoolError(f"{STOPPED}; the new ranks were ended")

    def after(self, outcome: Outcome, layout: ParallelConfig, died: list[int] | None = None,
              unlaid: list[int] | None = None) -> str:
        """The one entry point after each outcome: what is repaired, as the line that says so ("" for nothing).

        ``layout``: the cell's, decided once (a restart restores it); ``unlaid``: ranks that kept
        another layout while the others took it (interrupted while applying it).
        """
        if outcome.cancelled:
            return ""
        if outcome.died:
            return self.replace(f"rank(s) {died if died is not None else []} died", layout)
        if outcome.unreleased:
            return self.replace(f"rank(s) {outcome.unreleased} could not be released", layout)
        if unlaid:
            return self.replace(f"rank(s) {unlaid} did not take the layout {layout.describe()}", layout)
        return ""

    def replace(self, why: str, layout: ParallelConfig) -> str:
        """Replace every process (same size, device and ``layout``) without blocking the cell; one line says so."""
        with self._lock:
            old = self.generation
            if self.stopped:
                return f"{why}; {STOPPED}, so nothing was restarted"
            if self._thread is not None and self._thread.is_alive():
                return f"{why}; mnb is already restarting the ranks"
            # ranks on hosts joined by hand cannot be relaunched from here; a Slurm pool's job can
            # (the relaunch cancels it and submits a new one, as %mnb restart does)
            several_hosts = self.spec.nnodes > 1 and self.spec.slurm is None
            self.replaced_why = why
            if several_hosts:
                self.broken = why
            else:
                self.restarts += 1
                self._restore_latch = InterruptLatch()
                self._progress = {r: {"stage": "stopping the old ranks"} for r in range(self.spec.world_size)}
                self._thread = threading.Thread(target=self._relaunch, args=(old, layout), name="mnb-restart",
                                                daemon=True)
                self._thread.start()
        if several_hosts:
            if old is not None:
                old.close(grace_s=0)
            return (f"{why}; the pool spans {self.spec.nnodes} hosts, so mnb cannot restart it on its own: "
                    "run %mnb restart, then the join command on the other hosts")
        return (f"mnb is restarting all {self.spec.world_size} ranks ({why}); {layout_kept(layout)}, "
                "and the next cell waits for the new ranks.")

    def replace_if_dead(self, layout: ParallelConfig) -> str:
        """Replace the ranks in the background if one died while no request watched them ("" if none did).

        A request's collector sees a death while it waits; between requests nothing does, so
        ``status`` and the next request ask here (torchrun's exit, a zombie rank, a silent remote
        rank) and the replacement starts at once.
        """
        generation = self.generation
        if generation is None or generation.closed or self.stopped or not generation.any_dead():
            return ""
        dead = generation.launcher.dead_ranks() or sorted(generation.ranks)
        for rank in dead:
            if rank in generation.ranks:
                generation.ranks[rank].state = "dead"
        words = generation.transport.last_words  # e.g. a rank whose Megatron-Core import failed after its hello
        why = "".join(f"; rank {rank}: {last_words(message)}" for rank, message in sorted(words.items()))
        return self.replace(f"rank(s) {dead} died while the pool was idle{why}", layout)

    def wait(self, latch: InterruptLatch) -> None:
        """Wait for a restart under way (the next request's); raise what keeps requests from running."""
        thread = self._thread
        if thread is not None and thread.is_alive():
            print("mnb: waiting for the restarted ranks...", flush=True)
            try:
                while thread.is_alive():
                    thread.join(0.1)
                    if latch.cancelled:
                        raise PoolError(latch.cancelled)
                    if latch.take():
                        raise KeyboardInterrupt
            except KeyboardInterrupt:
                raise interrupted("stopped waiting for the restarting ranks; they go on starting "
                                  "in the background") from None
        if self.restart_line:
            line, self.restart_line = self.restart_line, ""
            print(f"mnb: {line}", flush=True)
        if self.stopped:  # not "broken": %mnb restart cannot bring it back (the magics forgot it at the stop)
            raise PoolError(f"{STOPPED}; {STOPPED_NEXT}")
        if self.generation is None and self.broken is None:
            raise PoolError("the pool is not running; start it with %mnb start (or %mnb restart)")
        if self.broken:
            raise PoolError(f"{self.broken}; run %mnb restart to bring the pool back")

    def stop(self) -> None:
        """Nothing relaunches from now on; a relaunch under way is cancelled and waited for."""
        with self._lock:
            self.stopped = True
            self.broken = self.broken or STOPPED
            self._cancel.set()
            thread, building = self._thread, self._building
        self._restore_latch.cancel(STOPPED)
        if building is not None:
            building.stop(grace_s=0)  # its hello wait sees torchrun exit and returns
        if thread is not None:
            thread.join()  # bounded: every wait in it watches the cancel

    # ------------------------------------------------------------ what status shows
    @property
    def ranks(self) -> dict[int, RankInfo]:
        """The current generation's rank table (rank -> pid, host, state, coordinates); replaced, never resized."""
        generation = self.generation
        return generation.ranks if generation is not None else {}

    @property
    def transport(self) -> Transport | None:
        """The current generation's transport while it is open (None: none yet, or closed)."""
        generation = self.generation
        return generation.transport if generation is not None and not generation.closed else None

    @property
    def restarting(self) -> bool:
        thread = self._thread
        return thread is not None and thread.is_alive()

    def rows(self, layout: ParallelConfig) -> list[dict[str, Any]] | None:
        """``status`` rows from a restart's own progress (None when no restart is under way)."""
        progress = self._progress
        if progress is None:
            return None
        shape = layout.as_dict()
        return [{
            "rank": rank, "pid": row.get("pid"), "host": row.get("host", ""), "state": f"restarting: {row['stage']}",
            "device": row.get("device", self.spec.device), "memory_bytes": None, "layout": layout.describe(),
            "coords": coords_label(rank, layout.coordinates(rank), shape),
            "torch": row.get("torch", ""), "megatron": row.get("megatron", ""),
        } for rank, row in sorted(progress.items())]

    def _stage(self, stage: str, rank: int | None = None, **fields: Any) -> None:
        progress = self._progress
        if progress is None:  # Pool.start/restart in the caller's thread: status waits for it, shows no progress
            return
        ranks = [rank] if rank is not None else list(progress)
        self._progress = {**progress, **{r: {**progress.get(r, {}), **fields, "stage": stage} for r in ranks}}

    def _on_hello(self, info: RankInfo) -> None:
        self._stage("ready", info.rank, pid=info.pid, host=info.host, device=info.device,
                    torch=info.torch_version, megatron=info.megatron_version)

    def _on_launched(self, launcher: Launcher) -> None:
        with self._lock:
            self._building = launcher
        if self._cancel.is_set():
            launcher.stop(grace_s=0)
        self._stage("launched")

    # ------------------------------------------------------------ the relaunch thread
    def _relaunch(self, old: Generation | None, layout: ParallelConfig) -> None:
        began = time.perf_counter()
        try:
            if old is not None:
                old.close(grace_s=0)  # stuck or dead ranks: nothing to wait for
            if self._cancel.is_set():
                return
            retried = ""
            try:
                self._adopt_in(self._build(on_launched=self._on_launched, on_hello=self._on_hello), layout)
            except PoolError as first:
                if self._cancel.is_set() or isinstance(first, LayoutRefused):
                    raise
                # A new rank that dies during its start is most often killed from outside (the OOM killer
                # while another process peaked, a stray signal): a second launch, cold, usually stands.
                # Said in the restart line; a second failure names both.
                log.warning("the automatic restart's first launch failed, launching again: %s", first)
                self._stage("launching again")
                try:
                    self._adopt_in(self._build(on_launched=self._on_launched, on_hello=self._on_hello), layout)
                except PoolError as second:
                    raise PoolError(f"{second}; a first launch had failed too: {first}") from first
                retried = f"; launched twice: the first launch failed ({first})"
            self.restart_line = (f"the {self.spec.world_size} ranks restarted in {time.perf_counter() - began:.1f} s "
                                 f"({self.start_note}{retried})")
            self.prepare_standby()
        except BaseException as exc:  # reported to the next request, which cannot run without ranks
            if self._cancel.is_set():  # Pool.stop()/restart() cancelled it: nothing failed
                log.debug("automatic restart cancelled: %s: %s", type(exc).__name__, exc)
                return
            with self._lock:
                self.broken = f"the automatic restart failed ({type(exc).__name__}: {exc})"
            log.warning("%s", self.broken)
        finally:
            with self._lock:
                self._building, self._progress = None, None

    def _adopt_in(self, generation: Generation, layout: ParallelConfig | None) -> None:
        """Put ``generation`` in ``layout`` (the default needs nothing), then adopt it; closed if either fails."""
        try:
            if layout is not None and layout != ParallelConfig().resolve(self.spec.world_size):
                self._stage(f"restoring {layout.describe()}")
                self._restore_layout(generation, layout)
            self.adopt(generation)
        except BaseException:
            generation.close(grace_s=0)
            raise

    def _restore_layout(self, generation: Generation, layout: ParallelConfig) -> None:
        """Put the new ranks in the layout the pool promised, through the generation's own inbox."""
        message = Message("execute", header={"layout": layout.as_dict(), "want_value": False})  # no code: no cell
        targets = sorted(generation.ranks)
        outcome = generation.exchange(message, targets, layout.as_dict(), self._restore_latch,
                                      timeout_s=self.start_timeout_s, grace_s=DEFAULT_GRACE_S, stream=False,
                                      event_handlers=[], on_stray=lambda message: None)
        for rank, reply in outcome.replies.items():
            generation.ranks[rank].coords = reply.get("coords") or generation.ranks[rank].coords
        failed = [m for m in outcome.replies.values() if not m.get("ok")]
        if failed and not (outcome.waiting or outcome.died):  # every rank answered: it would answer so again
            raise LayoutRefused(f"restoring the layout {layout.describe()} failed: "
                                + self._unrestored(generation, layout, outcome, failed, targets))
        if failed or outcome.waiting or outcome.died or outcome.cancelled or len(outcome.replies) < len(targets):
            raise PoolError(f"restoring the layout {layout.describe()} failed: "
                            + self._unrestored(generation, layout, outcome, failed, targets))

    def _unrestored(self, generation: Generation, layout: ParallelConfig, outcome: Outcome, failed: list[Message],
                    targets: list[int]) -> str:
        """Why the new ranks did not take the layout, in words that say what to look at: the ranks'
        errors, how a rank died (its exit, its last words), or which ranks a timeout left where."""
        if outcome.cancelled:
            return outcome.cancelled
        errors = "; ".join(f"{m.get('ename')}: {m.get('evalue')}" for m in failed)
        if outcome.died:
            deaths = generation.launcher.deaths(DEATH_REPORT_WAIT_S)
            for rank, message in sorted(generation.transport.last_words.items()):
                deaths[rank] = f"{deaths.get(rank, 'exited')}; {last_words(message)}"
            labels = {rank: coords_label(rank, layout.coordinates(rank), layout.as_dict()) for rank in generation.ranks}
            how = "; ".join(death_lines(deaths, labels)[0]) or "torchrun ended"
            return (f"a new rank died while taking it ({how}; log {generation.launcher.spec.log_file})"
                    + (f"; the others answered {errors}" if errors else ""))
        silent = sorted(outcome.waiting) or sorted(set(targets) - set(outcome.replies))
        if not silent:
            return errors
        where = "; ".join(f"rank {rank} at {at}" for rank, at in sorted(outcome.waiting.items()) if at)
        unanswered = (f"rank(s) {silent} did not answer within {self.start_timeout_s:.0f} s (the start timeout, "
                      f"%mnb start --timeout)" + (f": {where}" if where else ""))
        return f"{errors}; {unanswered}" if errors else unanswered
