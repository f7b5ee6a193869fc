"""What the driver does about a finding: diagnose, end the faulty processes, let the
elastic agents restart the job from its newest committed checkpoint.

:class:`Recovery` is a driver's ``on_finding`` policy (it runs on the driver's action
thread, one finding at a time). Each step is an event with its evidence:

- **crash** or **hang**: every rank still heard from is asked for its stacks; the
  suspects are the finding's ranks and every rank that does not answer within
  ``dump_timeout_s`` (a stopped rank, or one spinning with the GIL held, cannot). A
  silent rank is also asked through its node agent (faulthandler): one whose process
  answers without a heartbeat sender thread among its stacks is a **monitoring
  fault**, recorded and left running, not a suspect. Each
  suspect's node agent escalates it (its faulthandler stacks, SIGTERM, SIGKILL, each
  bounded). Its elastic agent then sees a failed worker and restarts the workers of
  every node, which resume from the newest committed checkpoint. With ``diagnose``,
  the suspects' nodes are then tested (:mod:`ms_health.diagnostics`) and the host of
  a node that fails goes on the ``blocklist``.
- **nonfinite** (a NaN or inf loss at step k): a rollback. Every rank is killed at once,
  without a graceful save (ms-train also never commits a step whose gradient norm is
  not finite), and the restart resumes from the newest checkpoint before k. After
  ``max_rollbacks`` rollbacks for the same step the policy stops rolling back (the NaN
  is in the data or the model, not a fluke) and says so.
- **straggler**, **loss_spike**, **throughput**: recorded; a straggler's node is
  diagnosed when ``diagnose`` is on. Nothing is killed for them.

While a restart it caused is under way, the policy does not act on the crash and hang
findings that the restart itself raises (every rank falls silent for a few seconds):
until each rank has reported from a new process (a newer restart round or another
pid), or ``settle_s`` passed. Nor on a finding raised before that restart was ordered
(it waited while the action ran): the restart replaces the processes it names.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from ms_health.findings import Finding

if TYPE_CHECKING:
    from ms_health.blocklist import Blocklist
    from ms_health.driver import Driver

__all__ = ["Recovery"]


class Recovery:
    """The default recovery policy; ``driver.on_finding = Recovery(driver)``.

    Args:
        driver: the driver whose findings it acts on.
        dump_timeout_s: how long live ranks get to answer a stack-dump request.
        action_timeout_s: how long an agent's escalation may take to report back.
        diagnose: test suspect nodes after a fault (and stragglers' nodes).
        blocklist: where nodes that fail their diagnostics go.
        max_rollbacks: rollbacks for the same NaN step before the policy stops.
        settle_s: the longest the policy waits for a restart it caused before it acts
            on crash or hang findings again.
        agent_slack_s: how much longer than ``dump_timeout_s`` a node agent's answer
            may take (it hears of an order at its next report, answers at the one after).
    """

    def __init__(
        self,
        driver: Driver,
        *,
        dump_timeout_s: float = 2.0,
        action_timeout_s: float = 30.0,
        diagnose: bool = False,
        blocklist: Blocklist | None = None,
        max_rollbacks: int = 2,
        settle_s: float = 120.0,
        agent_slack_s: float = 2.0,
    ) -> None:
        for name, value in (
            ("dump_timeout_s", dump_timeout_s),
            ("action_timeout_s", action_timeout_s),
            ("settle_s", settle_s),
            ("agent_slack_s", agent_slack_s),
        ):
            if not (isinstance(value, (int, float)) and value >= 0):
                raise ValueError(f"{name} must be a number >= 0, got {value!r}")
        if isinstance(max_rollbacks, bool) or not isinstance(max_rollbacks, int):
            raise ValueError(f"max_rollbacks must be an int >= 0, got {max_rollbacks!r}")
        self.driver = driver
        self.dump_timeout_s = dump_timeout_s
        self.action_timeout_s = action_timeout_s
        self.diagnose = diagnose
        self.blocklist = blocklist
        self.max_rollbacks = max_rollbacks
        self.settle_s = settle_s
        self.agent_slack_s = agent_slack_s
        # rank -> pid of ranks found to have lost their heartbeat sender
        self._unmonitored: dict[int, int] = {}
        self._rollbacks: dict[int, int] = {}
        # The restart round and the processes (rank -> pid) the last action ended: until
        # every rank reports from a new one, findings are the restart's own silence.
        self._acted_round: int | None = None
        self._acted_pids: dict[int, int] = {}
        # When (the driver's clock) that action had ended them: a finding raised before
        # is about processes the restart replaces; settle_s runs from here too.
        self._acted_clock: float | None = None
        self._lock = threading.Lock()

    def __call__(self, finding: Finding) -> None:
        with self._lock:
            if finding.kind in ("crash", "hang"):
                self._end_faulty(finding)
            elif finding.kind == "nonfinite":
                self._roll_back(finding)
            elif finding.kind == "straggler" and self.diagnose:
                self._diagnose_nodes(finding, self._nodes_of(finding.ranks))

    # ------------------------------------------------------------------ crash, hang

    def _restarting(self, finding: Finding) -> bool:
        """Whether ``finding`` is the silence of a restart this policy caused."""
        if self._acted_round is None:
            return False
        if self._acted_clock is None or self.driver.now() - self._acted_clock > self.settle_s:
            self._acted_round = None
            return False
        records = self.driver.last_records()
        ranks = set(records) | set(finding.ranks)
        acted_round, acted_pids = self._acted_round, self._acted_pids

        # Under way until every rank has reported from a new process: a newer restart
        # round, or another pid. Not the round alone: an elastic agent whose own workers
        # did not fail restarts them for the new rendezvous without counting a restart,
        # so its ranks come back in the round they left.
        def restarted(r: int) -> bool:
            rec = records.get(r)
            if rec is None:
                return False
            return rec.restart > acted_round or acted_pids.get(r) != rec.pid

        return not all(restarted(r) for r in ranks)

    def _stale(self, finding: Finding) -> bool:
        """Whether ``finding`` was raised before the last restart this policy caused
        (it waited in the queue while that action ran): the elastic restart replaces
        every process, the ones it names included. Recorded, not acted on."""
        if self._acted_clock is None or finding.at >= self._acted_clock:
            return False
        self._leave(
            finding,
            "raised before the restart already ordered (which replaces those processes)",
            acted_at=self._acted_clock,
        )
        return True

    def _leave(self, finding: Finding, why: str, **evidence: Any) -> None:
        """Record that ``finding`` is not acted on, and why."""
        at = "" if finding.step is None else f" at step {finding.step}"
        self.driver.record_event(
            "recovery",
            f"{finding.kind} of ranks {list(finding.ranks)}{at} {why}: not acted on",
            ranks=finding.ranks,
            evidence={"finding": finding.to_json(), **evidence},
        )

    def _end_faulty(self, finding: Finding) -> None:
        if self._stale(finding):
            return
        if self._restarting(finding):
            self._leave(finding, "during the restart under way", acted_round=self._acted_round)
            return
        records = self.driver.last_records()
        live = sorted(r for r, rec in records.items() if rec.status == "running")
        request = self.driver.request_dumps(live)
        # The finding's ranks, and any known to have lost its sender, are asked through
        # their node agents as well (a dead sender looks like a crash, and like a hang
        # to the step-progress detector): its process may answer where its heartbeat
        # cannot (both at once, so a real crash waits no longer).
        probed = [
            r for r in live if r in finding.ranks or self._unmonitored.get(r) == records[r].pid
        ]
        probes = self._order_dumps(probed, records)
        answered = self.driver.wait_dumps(request, self.dump_timeout_s)
        through_agent = self._wait_dumps(probes)
        unmonitored = self._monitoring_faults(finding, records, through_agent)
        silent = [r for r in live if r not in answered and r not in unmonitored]
        suspects = sorted((set(finding.ranks) - unmonitored) | set(silent))
        if finding.kind == "hang" and not silent:
            suspects = sorted(set(finding.ranks) - unmonitored)
        if not suspects:
            return  # a monitoring fault only: recorded, nothing to end
        self.driver.record_event(
            "diagnosis",
            f"{finding.kind}: suspects {suspects} (asked {live} for their stacks; "
            f"{len(answered)} answered, silent: {silent})",
            ranks=tuple(suspects),
            evidence={
                "finding": finding.to_json(),
                "asked": live,
                "answered": sorted(answered),
                "silent": silent,
                "last_ops": {str(r): d.last_op for r, d in answered.items()},
                "steps": {str(r): rec.step for r, rec in records.items()},
                "through_agent": {
                    str(r): {k: v for k, v in res.items() if k != "dump"}
                    for r, res in through_agent.items()
                },
            },
            level=logging.WARNING,
        )
        ended = self._escalate(suspects, records, term_timeout_s=None, why=finding.kind)
        self._mark_acted(records)
        if self.diagnose:
            self._diagnose_nodes(finding, self._nodes_of(suspects))
        self.driver.record_event(
            "recovery",
            f"{finding.kind}: ended {ended}; the elastic agents restart the workers from "
            "the newest committed checkpoint",
            ranks=tuple(suspects),
            evidence={"ended": ended},
        )

    # ------------------------------------------------------------------ NaN

    def _roll_back(self, finding: Finding) -> None:
        if self._stale(finding):
            return
        if self._restarting(finding):  # the other ranks' NaN of a step already handled
            self._leave(finding, "during the rollback under way", acted_round=self._acted_round)
            return
        step = -1 if finding.step is None else finding.step
        done = self._rollbacks.get(step, 0)
        if done >= self.max_rollbacks:
            self.driver.record_event(
                "recovery",
                f"non-finite loss at step {step} again after {done} rollback(s): not rolling "
                "back again (the cause is in the data or the model); the job goes on",
                ranks=finding.ranks,
                evidence={"finding": finding.to_json(), "rollbacks": done},
                level=logging.ERROR,
            )
            return
        self._rollbacks[step] = done + 1
        records = self.driver.last_records()
        everyone = sorted(r for r, rec in records.items() if rec.status == "running")
        self.driver.record_event(
            "rollback",
            f"non-finite loss at step {step}: ending every rank without a save; the "
            "restart resumes from the newest checkpoint before it",
            ranks=tuple(everyone),
            evidence={"finding": finding.to_json(), "rollback": done + 1},
            level=logging.WARNING,
        )
        ended = self._escalate(everyone, records, term_timeout_s=0.0, why="rollback")
        self._mark_acted(records)
        self.driver.record_event(
            "recovery",
            f"rollback from step {step}: ended {ended}",
            ranks=tuple(everyone),
            evidence={"ended": ended},
        )

    # ------------------------------------------------------------------ monitoring

    def _order_dumps(self, ranks: list[int], records: dict[int, Any]) -> dict[int, int]:
        """Ask each rank's node agent for its stacks; rank -> action id (a rank whose
        process no agent runs any more gets no order: it is gone)."""
        agents = self.driver.agents()
        orders: dict[int, int] = {}
        for rank in ranks:
            pid = records[rank].pid
            node = next((n for n, view in agents.items() if pid in view.workers.values()), None)
            if node is not None:
                orders[rank] = self.driver.order(
                    node, "dump", rank=rank, pid=pid, timeout_s=self.dump_timeout_s
                )
        return orders

    def _wait_dumps(self, orders: dict[int, int]) -> dict[int, dict[str, Any]]:
        """The agents' answers to :meth:`_order_dumps`, as far as they came in time: an
        agent hears of an order at its next report and answers at the one after."""
        deadline = time.monotonic() + self.dump_timeout_s + self.agent_slack_s
        found: dict[int, dict[str, Any]] = {}
        for rank, action_id in orders.items():
            result = self.driver.wait_result(action_id, max(0.0, deadline - time.monotonic()))
            if result is not None:
                found[rank] = dict(result)
        return found

    def _monitoring_faults(
        self,
        finding: Finding,
        records: dict[int, Any],
        through_agent: dict[int, dict[str, Any]],
    ) -> set[int]:
        """The ranks whose silence is their monitoring's, not their training's: the
        process answers for its stacks through its node agent (it is neither stopped nor
        gone) and its heartbeat sender thread is not among its threads. Its peers' steps
        go into the evidence; they decide nothing, since only a synchronous job holds its
        peers back. A rank spinning in C with the GIL held answers as well, but its
        sender thread is there, unable to run: it stays a suspect, as does a rank whose
        sender lives but cannot reach the driver (from here, the two look alike)."""
        from ms_health.executor import sender_in_stacks

        now = self.driver.last_records()
        found: set[int] = set()
        for rank, result in through_agent.items():
            record = records[rank]
            stacks = str(result.get("dump") or "")
            if not stacks or result.get("state") in (None, "T", "t", "Z"):
                continue
            if sender_in_stacks(stacks):
                continue
            peers = {
                r: rec.step
                for r, rec in now.items()
                if r != rank and r not in through_agent and rec.step is not None
            }
            found.add(rank)
            if self._unmonitored.get(rank) == record.pid:
                continue  # already reported; still the same process
            self._unmonitored[rank] = record.pid
            # The detectors forget its stale last heartbeat: left there, the rank would
            # look ever further behind, and a later hang of its peers would be pinned on
            # it. It is asked through its agent whenever the policy asks for stacks.
            self.driver.reset_detectors((rank,))
            self.driver.record_event(
                "monitoring_fault",
                f"rank {rank} (pid {record.pid}) sends no heartbeats, but its process answers "
                "for its stacks and its heartbeat sender is not among its threads: a "
                "monitoring fault, not a training one; it is not ended (last step "
                f"{record.step}, its peers' {max(peers.values(), default=None)})",
                ranks=(rank,),
                evidence={
                    "finding": finding.to_json(),
                    "pid": record.pid,
                    "state": result.get("state"),
                    "last_step": record.step,
                    "peer_steps": {str(r): s for r, s in peers.items()},
                    "stacks": stacks,
                },
                level=logging.WARNING,
            )
        return found

    # ------------------------------------------------------------------ helpers

    def _escalate(
        self,
        ranks: list[int],
        records: dict[int, Any],
        *,
        term_timeout_s: float | None,
        why: str,
    ) -> dict[str, str]:
        """Order each rank's agent to end it; rank -> outcome (as the agents report)."""
        orders: dict[int, int] = {}
        outcomes: dict[str, str] = {}
        agents = self.driver.agents()
        for rank in ranks:
            record = records.get(rank)
            if record is None:
                outcomes[str(rank)] = "unknown rank: never heard from"
                continue
            node = self._agent_node(record, agents)
            if node is None:
                outcomes[str(rank)] = f"no agent on node {record.node}: cannot act"
                self.driver.record_event(
                    "recovery",
                    f"rank {rank}: no node agent for node {record.node}; it cannot be ended "
                    "from here",
                    ranks=(rank,),
                    level=logging.ERROR,
                )
                continue
            params: dict[str, Any] = {"rank": rank, "pid": record.pid, "reason": why}
            if term_timeout_s is not None:
                params["term_timeout_s"] = term_timeout_s
            orders[rank] = self.driver.order(node, "escalate", **params)
        deadline = time.monotonic() + self.action_timeout_s
        for rank, action_id in orders.items():
            result = self.driver.wait_result(action_id, max(0.0, deadline - time.monotonic()))
            outcomes[str(rank)] = (
                "no answer from its agent"
                if result is None
                else str(result.get("escalation", {}).get("outcome", result.get("summary")))
            )
        return outcomes

    def _mark_acted(self, records: dict[int, Any]) -> None:
        rounds = [rec.restart for rec in records.values()]
        self._acted_round = max(rounds, default=0)
        self._acted_pids = {rank: rec.pid for rank, rec in records.items()}
        self._acted_clock = self.driver.now()
        # The ranks restart: what the detectors hold about the old processes (their
        # last steps, their silence) says nothing about the new ones.
        self.driver.reset_detectors()

    def _nodes_of(self, ranks: tuple[int, ...] | list[int]) -> list[str]:
        """The agents' nodes that run ``ranks`` (matched by pid, whatever each side calls
        the node)."""
        records = self.driver.last_records()
        agents = self.driver.agents()
        nodes: set[str] = set()
        for r in ranks:
            node = self._agent_node(records[r], agents) if r in records else None
            if node is not None:
                nodes.add(node)
        return sorted(nodes)

    def _agent_node(self, record: Any, agents: dict[str, Any]) -> str | None:
        """The agent's node for ``record``'s rank: the one that runs its process or last
        reported it (a dead rank's too), else the heartbeat's node if an agent goes by
        that name; None when no agent is known for it."""
        node = self.driver.node_of(record.pid)
        if node in agents:
            return node
        return record.node if record.node in agents else None

    def _diagnose_nodes(self, finding: Finding, nodes: list[str]) -> None:
        agents = self.driver.agents()
        orders = {n: self.driver.order(n, "diagnose") for n in nodes if n in agents}
        for node, action_id in orders.items():
            result = self.driver.wait_result(action_id, self.action_timeout_s + 120.0)
            if result is None:
                self.driver.record_event(
                    "diagnostics", f"node {node}: no diagnostics came back", level=logging.ERROR
                )
                continue
            ok = bool(result.get("ok"))
            self.driver.record_event(
                "diagnostics",
                f"node {node}: {'passed' if ok else 'FAILED'}: {result.get('summary', '')}",
                evidence={"node": node, "finding": finding.to_json(), "result": result},
                level=logging.INFO if ok else logging.ERROR,
            )
            if not ok and self.blocklist is not None:
                # The machine is what failed its checks: listed by host, so that any
                # launcher there (a later one, or another simulated node) sees it.
                host = agents[node].host or node
                self.blocklist.add(
                    host,
                    f"diagnostics failed after {finding.kind} of ranks {list(finding.ranks)}: "
                    + _one_line(result),
                    {"node": node, "result": result},
                )
                self.driver.record_event(
                    "blocklist",
                    f"host {host} (node {node}) put on the blocklist",
                    evidence={"node": node, "host": host},
                    level=logging.ERROR,
                )


def _one_line(result: dict[str, Any], limit: int = 300) -> str:
    """The failed checks of an agent's diagnosis (the report's own ``failures``), on one
    line; its summary's first line when it has no report (the diagnosis raised)."""
    failures = result.get("report", {}).get("failures") or []
    text = "; ".join(str(f) for f in failures)
    text = text or str(result.get("summary", "")).strip().split("\n", 1)[0] or "no summary"
    return text if len(text) <= limit else text[: limit - 3] + "..."
