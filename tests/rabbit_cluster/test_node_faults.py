"""Nodes killed, frozen, cut off and restarted while a backlog drains into quorum queues.

Each test runs one fault of issue 37 on the three-node cluster
(tests/rabbit_cluster/cluster.py) while a backlog of :data:`scenario.BACKLOG`
jobs drains, the application keeps staging and a real ``celery worker``
consumes, and checks what a Jepsen-style checker checks
(tests/rabbit_cluster/scenario.py): nothing lost, duplicates counted, and
the drain publishing again within :data:`RESUME_BOUND` seconds of the
cluster's own recovery. Each prints its figures (``[cluster] ...``).
"""

from __future__ import annotations

import re
import time

import pytest

from tests import support
from tests.rabbit_cluster.cluster import Node
from tests.rabbit_cluster.scenario import Scenario

pytestmark = [pytest.mark.rabbit_cluster, pytest.mark.timeout(600)]

#: Seconds from the cluster's recovery until the drain publishes again (issue 37).
RESUME_BOUND = 5.0
#: How long a frozen node stays frozen: longer than the app's 5 s heartbeat,
#: twice over, so the drain and the other nodes both give up on it.
FROZEN = 20.0


def _led_from(scenario: Scenario, which: str) -> Node:
    """Start the scenario with the queue led by ``which`` ("the leader's node": the
    second, declared through it, while the drain publishes through the first; "the
    drain's node": the first, where the drain declares it) and wait until the
    backlog is under way; that node."""
    nodes = scenario.cluster.nodes
    leader = nodes[1] if which == "the leader's node" else nodes[0]
    if leader is nodes[1]:
        with leader.channel() as channel:
            channel.queue_declare(scenario.queue, durable=True,
                                  arguments={"x-queue-type": "quorum"})
    scenario.start()
    assert scenario.leader() == leader.name
    scenario.mid_backlog()
    return leader


def _lasting(since: float) -> None:
    """Until the fault begun at ``since`` has lasted FROZEN seconds."""
    support.wait_for(lambda: time.monotonic() - since >= FROZEN, FROZEN + 5,
                     f"the fault to last {FROZEN:g} s")


def _new_leader(scenario: Scenario, old: Node, via: Node) -> float:
    """Until ``via`` names another leader than ``old``; when it did."""
    support.wait_for(lambda: scenario.leader(via) not in ("", old.name), 60,
                     f"a leader other than {old.name}", interval=0.05)
    return time.monotonic()


def _check(scenario: Scenario, fault: str, fault_at: float, recovered_at: float) -> None:
    outcome = scenario.finish(fault_at, recovered_at)
    scenario.report(fault, outcome)
    assert outcome.lost == 0
    assert outcome.resume < RESUME_BOUND, scenario.drain_log()


@pytest.mark.parametrize("killed", ["the leader's node", "the drain's node"])
def test_a_node_killed_and_restarted(scenario: Scenario, killed: str) -> None:
    """kill -9 mid-backlog, then a restart, of the queue's leader (declared on the
    second node; the drain publishes through the first), or of the node the
    drain publishes through when it also leads the queue: the production
    default, as clients list the same node first and the leader goes where the
    declaring client is connected. The node's death is said in one line that
    names it, and the drain fails over to the next node."""
    nodes = scenario.cluster.nodes
    victim = _led_from(scenario, killed)
    witness = nodes[0] if victim is nodes[1] else nodes[1]
    killed_at = time.monotonic()
    scenario.cluster.kill(victim)
    recovered_at = _new_leader(scenario, victim, witness)
    scenario.published_after(recovered_at)
    scenario.cluster.restart(victim)
    _check(scenario, f"kill -9 of {killed}, then its restart", killed_at, recovered_at)
    if victim is nodes[0]:
        log = scenario.drain_log()
        shown = f"amqp://guest:***@{victim.address}:{victim.port}//"
        assert re.search(rf"WARNING drain\.outages: broker at {re.escape(shown)}.*"
                         r"(lost|reset|closed)", log), log
        assert "(2 of 3)" in log, log


@pytest.mark.parametrize("frozen", ["the leader's node", "the drain's node"])
def test_a_node_frozen_past_the_heartbeat(scenario: Scenario, frozen: str) -> None:
    """SIGSTOP of a node for longer than the heartbeat, then SIGCONT: the queue's
    leader (declared on the second node; the drain is on the first), or the
    node the drain publishes through, which also leads the queue. The cluster
    recovers from the first when the other two elect a leader. From the second
    the drain recovers when its heartbeat gives the node up (within
    2 x (heartbeat + 5) s: 20 s with the app's 5 s) or when the node thaws, the
    first of the two: the recovery counts from the thaw."""
    nodes = scenario.cluster.nodes
    victim = _led_from(scenario, frozen)
    frozen_at = time.monotonic()
    scenario.cluster.freeze(victim)
    elected_at = _new_leader(scenario, victim, nodes[2])
    _lasting(frozen_at)
    scenario.cluster.thaw(victim)
    recovered_at = elected_at if victim is nodes[1] else time.monotonic()
    _check(scenario, f"SIGSTOP of {frozen} for {FROZEN:g} s, then SIGCONT",
           frozen_at, recovered_at)


@pytest.mark.parametrize("cut", ["the drain's node", "another node"])
def test_a_partition_of_one_node(scenario: Scenario, cut: str) -> None:
    """One node is cut off from the other two (iptables): the drain's own node,
    which leads the queue, or the third one. With pause_minority, the cut-off
    node stops serving clients; the majority elects a leader and goes on."""
    scenario.start()
    nodes = scenario.cluster.nodes
    victim = nodes[0] if cut == "the drain's node" else nodes[2]
    scenario.mid_backlog()
    cut_at = time.monotonic()
    scenario.cluster.partition(victim)
    # Another node cut off: the leader and the drain are in the majority.
    recovered_at = _new_leader(scenario, victim, nodes[1]) if victim is nodes[0] else cut_at
    scenario.published_after(recovered_at)
    _lasting(cut_at)
    scenario.cluster.heal()
    # The drain's own node cut off: pause_minority closes its connections ~5 s in,
    # and the drain goes on through the next node, which may answer nothing on its
    # new channel (RabbitMQ 3.10 was seen silent for 17 s, the queue without a leader
    # when the channel first published): after MUTE_WAIT the drain replaces the
    # channel, or the connection when a new channel does not open either
    # (drain.broker.channels, ``replace_mute``).
    _check(scenario, f"a partition of {cut} for {FROZEN:g} s", cut_at, recovered_at)


def test_restart_of_the_whole_cluster(scenario: Scenario) -> None:
    """All three nodes stopped (SIGTERM, one after another), then started again:
    the drain waits, keeps every row staged, and publishes again once the
    cluster is back."""
    scenario.start()
    cluster = scenario.cluster
    scenario.mid_backlog()
    stopped_at = time.monotonic()
    for node in reversed(cluster.nodes):
        cluster.stop_node(node)
    for node in cluster.nodes:
        cluster.start_node(node)
    for node in cluster.nodes:
        cluster.wait_up(node)
    cluster.wait_clustered()
    recovered_at = time.monotonic()
    _check(scenario, "a restart of the whole cluster", stopped_at, recovered_at)


def test_a_classic_queue_whose_node_is_down_holds_only_its_own_rows(
        scenario: Scenario) -> None:
    """A classic (non-replicated) queue lives on one node: while that node is down
    its rows stay staged, the reason is in the log and on /metrics, and the
    quorum queue's jobs keep flowing. Once the node is back, they go out."""
    nodes = scenario.cluster.nodes
    classic = scenario.classic_queue
    with nodes[0].channel() as channel:
        channel.queue_declare(classic, durable=True)  # lives on the first node
    scenario.start()
    scenario.stage(100, task="cluster.classic")
    support.wait_for(lambda: scenario.staged_of("cluster.classic") == 0, 60,
                     "the classic queue's first jobs to go out")
    killed_at = time.monotonic()
    scenario.cluster.kill(nodes[0])
    recovered_at = _new_leader(scenario, nodes[0], nodes[1])
    scenario.stage(100, task="cluster.classic")
    before = scenario.progress[-1][1]
    # The quorum queue's jobs flow (the application keeps staging them)...
    support.wait_for(lambda: scenario.progress[-1][1] >= before + 100, 60,
                     "the quorum queue's jobs to flow while the classic queue is down")
    # ... while the classic queue's stay staged, and the drain says why.
    assert scenario.staged_of("cluster.classic") == 100
    support.wait_for(lambda: classic in scenario.drain_log(), 30,
                     "the drain to name the classic queue")
    assert "home node" in scenario.drain_log(), scenario.drain_log()
    assert (scenario.metric("drain_declare_refused_total") or 0) > 0, scenario.drain_log()
    scenario.cluster.restart(nodes[0])
    support.wait_for(lambda: scenario.staged_of("cluster.classic") == 0, 90,
                     "the classic queue's jobs to go out once its node is back")
    _check(scenario, "a classic queue's node down (kill -9, restart)", killed_at, recovered_at)
