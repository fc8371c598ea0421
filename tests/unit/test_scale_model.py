"""bench/scale_model.py: the scale model's terms, each against a hand count or a
closed form, and the shape of its answers (one rank has no exchange, a CPU share
stretches a step, fp16 halves the rows' bytes, two-level pays at scale only)."""

import dataclasses
import itertools
import math

import pytest

from bench import scale_model as sm

SHM = sm.Link("shm", stage_s=20e-6, message_s=0.5e-6, bandwidth=4e9)
TCP = sm.Link("tcp", stage_s=50e-6, message_s=8e-6, bandwidth=25 * sm.GBIT)
W = sm.Workload(batch=4096, ids_per_sample=26, unique_frac=0.5, dim=9, n_dense=90_000,
                compute_s=0.035, tables_s=0.010, plan_s=0.002, apply_s=0.002, multi_s=0.001)


def cluster(P, L=None, share=1.0, intra=SHM, inter=TCP):
    return sm.Cluster(P, L or min(P, 8), intra, inter, cpu_share=share)


def test_messages_are_kvcolls_counts():
    # bench/results/topology.md, 3 hosts x 2 (Comm.messages): flat pull:ids 10, pull:rows
    # 5, push:grads 5; two-level 6, 4, 4
    assert sum(sm.messages(6, 2, "flat")) == 20
    assert sum(sm.messages(6, 2, "two-level")) == 14
    for P, L in ((64, 8), (1024, 32), (12, 3)):
        H = P // L
        assert sm.messages(P, L, "flat") == (4 * (L - 1), 4 * (P - L))
        assert sm.messages(P, L, "two-level") == (6 * (L - 1), 4 * (H - 1))
    assert sm.messages(1, 1, "flat") == (0, 0) and sm.stages(1, 1, "two-level") == []
    with pytest.raises(ValueError, match="topology 'tree'"):
        sm.stages(4, 2, "tree")


def test_one_rank_is_its_cpu_alone():
    st = sm.step_seconds(W, cluster(1))
    assert st.latency == st.bytes == st.allreduce == 0
    assert st.total == pytest.approx(W.compute_s + W.tables_s + W.plan_s + W.apply_s)
    assert sm.efficiency(W, cluster(1)) == pytest.approx(1.0)
    assert sm.samples_per_sec(W, cluster(1)) == pytest.approx(W.batch / st.total)


def test_a_cpu_share_stretches_everything_a_rank_does():
    full, third = sm.step_seconds(W, cluster(6, 2)), sm.step_seconds(W, cluster(6, 2, 1 / 3))
    for a, b in ((full.cpu, third.cpu), (full.latency, third.latency),
                 (full.bytes, third.bytes), (full.allreduce, third.allreduce)):
        assert b == pytest.approx(3 * a)
    with pytest.raises(ValueError, match="cpu_share"):
        cluster(4, 2, share=0)
    with pytest.raises(ValueError, match="do not fill hosts"):
        sm.Cluster(6, 4, SHM, TCP)
    with pytest.raises(ValueError, match="link 'x'"):
        sm.Link("x", -1, 0, 1)


def test_bytes_by_hand_flat():
    c = cluster(16, 8)
    st = sm.step_seconds(W, c, "flat", wire_bytes=4)
    u = W.batch * W.ids_per_sample * W.unique_frac
    per = 8 * u + 2 * u * W.dim * 4                # ids, rows, gradients
    nic = TCP.bandwidth / 8                          # 8 ranks share the host's link
    want = per * 7 / 16 / SHM.bandwidth + per * 8 / 16 / nic
    assert st.bytes == pytest.approx(want)
    # fp16 rows and gradients: the ids stay 8 bytes
    half = sm.step_seconds(W, c, "flat", wire_bytes=2).bytes
    assert half == pytest.approx(want * (8 * u + 2 * u * W.dim * 2) / per)


def test_latency_by_hand():
    st = sm.step_seconds(W, cluster(16, 8), "flat")
    assert st.latency == pytest.approx(4 * (TCP.stage_s + 7 * SHM.message_s
                                            + 8 * TCP.message_s))
    two = sm.step_seconds(W, cluster(16, 8), "two-level")
    # ids: 4 stages, rows and gradients 3 each; 7 messages inside, 1 across per stage
    want = (2 * (SHM.stage_s + 7 * SHM.message_s) + 2 * (TCP.stage_s + TCP.message_s)
            + 2 * (2 * (SHM.stage_s + 7 * SHM.message_s) + TCP.stage_s + TCP.message_s))
    assert two.latency == pytest.approx(want)


def test_allreduce_is_libnbcs_choice():
    small, big = 4 * 1000, 4 * 1_000_000
    # below 64 KiB (or P < 4): binomial, 2 log2 P rounds of the whole vector
    assert sm.allreduce_seconds(small, 16, TCP) == pytest.approx(
        8 * (TCP.stage_s + TCP.message_s + small / TCP.bandwidth))
    assert sm.allreduce_seconds(big, 2, TCP) == pytest.approx(
        2 * (TCP.stage_s + TCP.message_s + big / TCP.bandwidth))
    # above: reduce-scatter + allgather, 2 (P-1)/P of the bytes
    assert sm.allreduce_seconds(big, 16, TCP) == pytest.approx(
        8 * (TCP.stage_s + TCP.message_s) + 2 * 15 / 16 * big / TCP.bandwidth)
    assert sm.allreduce_seconds(big, 1, TCP) == 0
    assert sm.allreduce_seconds(big, 1000, TCP) == pytest.approx(
        2 * math.ceil(math.log2(1000)) * (TCP.stage_s + TCP.message_s)
        + 2 * 999 / 1000 * big / TCP.bandwidth)


def test_the_pipeline_hides_the_id_exchange_at_most_behind_compute():
    c = cluster(256, 8)
    plain, piped = sm.step_seconds(W, c, "flat"), sm.step_seconds(W, c, "flat", pipelined=True)
    assert 0 < piped.overlap <= W.compute_s
    assert piped.total == pytest.approx(plain.total - piped.overlap)
    assert piped.overlap == pytest.approx(
        W.plan_s + piped.parts["latency:ids:counts"] + piped.parts["latency:ids"]
        + piped.parts["bytes:ids"])
    tiny = sm.Workload(**{**W.__dict__, "compute_s": 1e-6})
    assert sm.step_seconds(tiny, c, "flat", pipelined=True).overlap == pytest.approx(1e-6)


def test_efficiency_falls_with_ranks_and_two_level_pays_at_scale():
    flat = [sm.efficiency(W, cluster(P), "flat") for P in (8, 64, 512, 1024)]
    assert all(a > b for a, b in itertools.pairwise(flat)) and flat[0] < 1
    # many hosts: (L-1) + (H-1) messages instead of P-1 win
    assert sm.two_level_wins(W, cluster(1024, 8))
    # two hosts of 2: the extra stages cost more than the 2 messages a stage it saves
    assert not sm.two_level_wins(W, cluster(4, 2))
    # faster networks, fewer bytes: better
    fast = sm.Link("100G", TCP.stage_s, TCP.message_s, 100 * sm.GBIT)
    assert sm.efficiency(W, cluster(256, inter=fast)) > sm.efficiency(W, cluster(256))
    assert sm.efficiency(W, cluster(256), wire_bytes=2) > sm.efficiency(W, cluster(256))


def test_two_level_threshold_is_where_two_level_starts_to_win_for_good():
    P = sm.two_level_threshold(W, SHM, TCP, most=1024)
    assert 4 < P <= 1024
    for Q in range(P, 1025):
        for L in (2, 4, 8, 16, 32):
            if Q % L == 0 and Q // L >= 2:
                assert sm.two_level_wins(W, sm.Cluster(Q, L, SHM, TCP)), (Q, L)
    # just below it, some shape still prefers flat
    below = [(Q, L) for Q in range(4, P) for L in (2, 4, 8, 16, 32)
             if Q % L == 0 and Q // L >= 2
             and not sm.two_level_wins(W, sm.Cluster(Q, L, SHM, TCP))]
    assert below and max(q for q, _ in below) == max(
        q for q in range(4, P) if any(q % L == 0 and q // L >= 2 for L in (2, 4, 8, 16, 32)))
    # a link whose messages are free never makes two-level worth it
    free = sm.Link("free", TCP.stage_s, 0.0, TCP.bandwidth)
    assert sm.two_level_threshold(W, SHM, free, most=256) == 257


def test_the_schedulers_handoffs_are_a_wait_per_collective_and_corunner():
    # flat: 4 stages + the allreduce, each with every other rank; two-level (3 hosts x 2):
    # 6 stages with the 1 other rank of the host and 4 with the 2 others of the local
    # rank, each of 5 other ranks, + the allreduce
    assert sm.collectives(6, 2, "flat") == 5
    assert sm.collectives(6, 2, "two-level") == pytest.approx(6 / 5 + 4 * 2 / 5 + 1)
    assert sm.collectives(1, 1, "flat") == 0
    # hosts of one rank: two-level's stages inside a host send nothing, so do not wait
    assert sm.collectives(4, 1, "two-level") == pytest.approx(5)
    c = sm.Cluster(6, 2, SHM, TCP, cpu_share=1 / 3, corunners=2, handoff_s=1e-3)
    bare = dataclasses.replace(c, handoff_s=0.0)
    for topo, n in (("flat", 5), ("two-level", 3.8)):
        st, st0 = sm.step_seconds(W, c, topo), sm.step_seconds(W, bare, topo)
        assert st.handoffs == pytest.approx(n * 2 * 1e-3)     # a wait: not stretched by share
        assert st.total - st0.total == pytest.approx(st.handoffs)
        assert st0.handoffs == 0 and "handoffs" not in st0.parts
    # a core per rank (the curves): no co-runner, no term, whatever handoff_s says
    own = cluster(256, 8)
    assert sm.step_seconds(W, dataclasses.replace(own, handoff_s=5e-3), "two-level").total \
        == pytest.approx(sm.step_seconds(W, own, "two-level").total)
    with pytest.raises(ValueError, match="corunners and handoff_s"):
        sm.Cluster(4, 2, SHM, TCP, corunners=-1)


def test_corunners_are_the_tasks_beyond_the_cores_on_the_slowest_ranks_core():
    from bench.scale_bench import corunners
    assert [corunners(2, p) for p in (1, 2, 3, 4, 5, 6)] == [0, 0, 1, 1, 2, 2]
    assert corunners(2, 2, others=0.8) == 1 and corunners(2, 2, others=0.3) == 0
    assert corunners(32, 8) == 0
