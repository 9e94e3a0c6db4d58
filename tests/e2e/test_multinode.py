"""Two torchrun agents on 127.0.0.1 as two "nodes" of two processes each (c10d rendezvous).

Layout tp2 x ep2 (dp2): tensor-parallel groups stay within a node (ranks 0-1, 2-3), data- and
expert-parallel groups cross the nodes, as on a real cluster. Node 0 hosts the rendezvous store
(``is_host``), as the first node of a real launch does.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Sequence

import pytest

from .harness import (
    LAYOUT_DEPENDENT,
    TINY,
    Launch,
    assert_records_close,
    assert_required_metrics,
    free_port,
    read_metrics,
    start,
    tail,
    train_command,
    wait_for_step,
)

pytestmark = pytest.mark.distributed

FAILURE_DEADLINE_S = 120
"""How long the surviving node may take to stop once the other one is gone."""


def start_two_nodes(output_dir, steps: int, extra: Sequence[str] = ()) -> list[Launch]:
    port = free_port()
    overrides = [
        "--preset",
        "cpu_tiny_4proc",  # tp2 x ep2
        f"steps={steps}",
        *TINY,
        f"output_dir={output_dir}",
        *extra,
    ]
    launches = []
    for node in (0, 1):
        torchrun = [
            "--nnodes=2",
            f"--node_rank={node}",
            "--rdzv_backend=c10d",
            f"--rdzv_endpoint=127.0.0.1:{port}",
            f"--rdzv_id=e2e{port}",
            f"--rdzv_conf=is_host={int(node == 0)}",
        ]
        command = train_command(overrides, nproc=2, torchrun_args=torchrun)
        launches.append(start(command, output_dir, f"node{node}.log"))
    return launches


def test_two_nodes_match_one_process(gspo_run, tmp_path):
    output_dir = tmp_path / "out"
    launches = start_two_nodes(output_dir, steps=2)
    try:
        returncodes = [launch.wait(timeout=300) for launch in launches]
    finally:
        for launch in launches:
            launch.kill()
    assert returncodes == [0, 0], "\n".join(tail(launch.log, 3000) for launch in launches)
    # Only global rank 0 writes: one record per step, not one per node.
    records = launches[0].metrics()
    assert_required_metrics(records, steps=2)
    reference = gspo_run.metrics()[0]
    assert_records_close(reference, records[0], rtol=1e-5, atol=1e-6, skip=LAYOUT_DEPENDENT)
    assert sorted(os.listdir(output_dir / "tensorboard"))[0].startswith("events.out.tfevents")
    assert len(os.listdir(output_dir / "tensorboard")) == 1


@pytest.mark.slow
def test_killed_agent_stops_the_other_node(tmp_path):
    """SIGKILL node 1's torchrun agent (its process group) mid-run.

    torchrun starts its workers in sessions of their own, so they outlive the agent; each worker
    notices it was re-parented and exits (``train.exit_with_agent``), node 0's next collective
    with node 1 then fails (gloo: connection reset by peer) and node 0's agent exits non-zero.
    Without that, node 1's orphaned workers would keep training unsupervised and node 0's agent
    would wait 300 s at its exit barrier.
    """
    output_dir = tmp_path / "out"
    launches = start_two_nodes(output_dir, steps=100)
    survivor, victim = launches
    try:
        wait_for_step(launches, output_dir, 0, timeout=240)
        for launch in launches:
            launch.remember_tree()  # for the cleanup below: orphans are no one's children
        os.killpg(victim.process.pid, signal.SIGKILL)
        killed = time.monotonic()
        returncode = survivor.wait(timeout=FAILURE_DEADLINE_S)
        seconds = time.monotonic() - killed
    finally:
        for launch in launches:
            launch.kill()
    assert returncode != 0, tail(survivor.log)
    assert seconds < FAILURE_DEADLINE_S
    assert "the torchrun agent" in victim.log and "is gone" in victim.log, tail(victim.log)
    assert "megatron_gspo.train FAILED" in survivor.log, tail(survivor.log)
    assert len(read_metrics(output_dir)) < 100
    print(f"node 0 exited {returncode} {seconds:.1f} s after node 1's agent was killed")
