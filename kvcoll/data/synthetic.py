"""A synthetic CTR data set with a planted ground-truth model, generated per sample.

Each sample has `num_categorical` id fields (26 by default, like Criteo), `num_numeric`
numeric fields (13) and a 0/1 label. Everything about global sample i — its ids, its
numbers, its label — is a pure function of (seed, stream, i), computed with a
counter-based hash (splitmix64 of `key[stream, channel] + i * golden`), in C
(csrc/synth/kv_synth.c; this module derives the parameters). Nothing is generated
sequentially, so:

- the global batch of step t is samples [t*B, (t+1)*B) of the training stream; it
  depends on the seed, t and B only, never on the world size, and a rank generates
  just its own slice (`even_split`), without generating the others;
- evaluation samples come from a separate stream (a different hash key), so they are
  never training samples, however long training runs.

Ids. Per field, a rank r in [0, vocab) is drawn from a Zipf-like law by inverting the
CDF of a continuous power law with exponent `zipf_a` truncated to [1, vocab+1):
P(rank r) is the law's mass on [r+1, r+2), about proportional to (r + 1.5)^-a. Ranks
are then scrambled by a per-field bijection of [0, vocab) (xorshift-multiply rounds on
the largest power-of-two block, alternating with rotations mod vocab), so frequent ids
are not small integers. Fields never share an id: field f's ids lie in
[offsets[f], offsets[f] + vocab[f]), with offsets the running sum of the vocabularies;
`total_vocab` is the size of the whole id space (handy for a fixed-vocabulary baseline).

Numbers. numeric_j = log1p(exp(mu_j + sigma_j * z)) with z ~ N(0, 1): a log1p-normalised
lognormal count, as Criteo's integer features look after the usual log1p transform.

Planted model. The label is Bernoulli(sigmoid(logit)) with

    logit = bias + sum_f w_f(r_f) + sum_{f<g} <v_f(r_f), v_g(r_g)> + sum_j beta_j x_j'

where w_f(r) (a weight) and v_f(r) (a 4-dim vector) are pseudo-random functions of
(seed, field, rank) (uniform, from one hash), scaled by a per-field importance and by
1/sqrt(1 + r/200): frequent ids carry most of the signal, so a model that sees a few
million samples can learn most of it, while the rare tail adds signal that cannot be
learnt, as in real logs. x_j' is numeric_j centred; the bias is calibrated (on a fixed
sample of a stream of its own) so that the mean label is about 0.25.
`planted_logit(batch)` recovers the ranks from the ids (the scrambling is invertible)
and returns exactly the logit the labels were drawn from, so `planted_auc` is the best
AUC any model can reach on the data (the Bayes AUC).

With the defaults (26 + 13 fields, vocab 10^7, zipf_a 1.1) the planted AUC is 0.80-0.82
depending on the seed, and the mean label 0.25 (`tests/unit/test_data.py` holds them
to 0.77-0.84 and 0.2-0.3). A DeepFM that keeps an embedding for the 32k most frequent
ids of each field reaches 0.775 after 2000 steps of 4096 samples and 0.78 after 3000
(seed 0, planted 0.805): most of the signal is learnable, not all.

Generating a 4096-sample batch takes about 1 ms of one core with AVX-512 (1.4 ms with
AVX2, 2.7 ms without: the kernel picks its compiled copy from the CPU, all copies giving
the same bits). Samples and logits are bit for bit the same whichever batch, chunk or
rank slice they are generated in (no BLAS, no reduction across samples). Methods do not
mutate the object and the C kernel keeps no state, so one instance can serve a
prefetching thread.

    >>> data = SyntheticCTR(seed=1)
    >>> b = data.batch(step=7, global_batch_size=4096, rank=1, world=4)   # 1024 samples
    >>> b["categorical"].shape, b["numeric"].shape, b["label"].shape
    ((1024, 26), (1024, 13), (1024,))
    >>> ev = data.eval_set(50_000)
    >>> auc(ev["label"], data.planted_logit(ev))                           # about 0.80
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np

from ..errors import InvalidArgumentError
from ._synth_c import SYNTH_PERM_ROUNDS, SynthModel, SynthPermutation
from .position import Positioned, PositionError
from .shard import even_split

__all__ = ["EVAL", "TRAIN", "SyntheticBatches", "SyntheticCTR", "auc"]

TRAIN = "train"
EVAL = "eval"
_STREAMS = {TRAIN: 0, EVAL: 1}
_CALIBRATION_STREAM = 2

_M64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15          # 2^64 / golden ratio: the splitmix64 increment
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB

# Hash-key tags, so no two uses of the seed ever share a key.
_TAG_SAMPLE, _TAG_PERM, _TAG_PARAM, _TAG_FIELD, _TAG_NUMERIC = range(1, 6)

# The planted model. Scales are per field, normalised by the number of fields (and of
# field pairs), so the planted AUC does not move much with num_categorical. The signal
# scale of rank r, 1 / sqrt(1 + r / 200), is fixed in csrc/synth/kv_synth.c (RANK_SCALE).
_WEIGHT_SCALE = 1.8      # first-order logit std if every id had rank 0 (all fields)
_VECTOR_SCALE = 1.0      # interaction logit std if every id had rank 0 (all pairs)
_NUMERIC_SCALE = 0.5     # std of the numeric linear term (roughly)
_TARGET_CTR = 0.25       # the bias is calibrated to this mean label, like Criteo's
_VECTOR_DIM = 4          # width of the planted interaction vectors (KV_SYNTH_PARTS)


def _mix_int(x: int) -> int:
    """splitmix64's finaliser on a Python int (for deriving keys)."""
    x &= _M64
    x = ((x ^ (x >> 30)) * _MIX1) & _M64
    x = ((x ^ (x >> 27)) * _MIX2) & _M64
    return x ^ (x >> 31)


def _key(*parts: int) -> int:
    """A 64-bit hash key of a tuple of ints (seed, tag, field, ...)."""
    h = 0x243F6A8885A308D3
    for p in parts:
        h = _mix_int((h ^ (p & _M64)) + _GAMMA)
    return h


def _unit(h: np.ndarray) -> np.ndarray:
    """The top 53 bits of a hash as a float64 uniform in [0, 1)."""
    return (h >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


class _Permutation:
    """Per-field bijections of [0, vocab_f), invertible, loop-free (applied in C).

    With M the largest power of two <= vocab (so M > vocab / 2), the map alternates
    two bijections of [0, vocab):
      A: values below M go through an xorshift-multiply-xorshift bijection of [0, M);
         values in [M, vocab) stay;
      B: a rotation, x -> (x + c) mod vocab, which moves values into and out of [0, M).
    as A B A B A, with different constants per round and per field. Unlike cycle
    walking there is no data-dependent loop: every element costs the same few ops.
    A's round r on x < M: y = (x + add) & mask; y ^= y >> shift; y = (y * mul) & mask;
    y ^= y >> shift (csrc/synth/kv_synth.h; this class derives the constants).
    """

    ROUNDS = SYNTH_PERM_ROUNDS

    def __init__(self, seed: int, vocab: np.ndarray):
        nf, nr = vocab.size, self.ROUNDS
        bits = [int(v).bit_length() - 1 for v in vocab]         # M = 2^bits <= vocab
        self.vocab = vocab.astype(np.uint64)
        self.mask = np.array([(1 << b) - 1 for b in bits], np.uint64)   # M - 1
        self.shift = np.array([max(1, (b + 1) // 2) for b in bits], np.uint64)  # 2*shift >= bits
        self.add = np.zeros((nr, nf), np.uint64)
        self.mul = np.zeros((nr, nf), np.uint64)
        self.inv = np.zeros((nr, nf), np.uint64)
        self.rot = np.zeros((nr - 1, nf), np.uint64)
        for f in range(nf):
            for r in range(nr):
                self.add[r, f] = _key(seed, _TAG_PERM, f, r, 0) & int(self.mask[f])
                m = _key(seed, _TAG_PERM, f, r, 1) | 1
                self.mul[r, f], self.inv[r, f] = m, pow(m, -1, 1 << 64)
            for r in range(nr - 1):
                self.rot[r, f] = _key(seed, _TAG_PERM, f, r, 2) % int(vocab[f])
        self.kernel = SynthPermutation(self.vocab, self.mask, self.shift, self.add, self.mul,
                                       self.inv, self.rot)

    def forward(self, ranks: np.ndarray) -> np.ndarray:
        """[n, F] uint64 ranks -> [n, F] uint64 scrambled local ids."""
        return self.kernel.apply(ranks)

    def inverse(self, local: np.ndarray) -> np.ndarray:
        """[n, F] uint64 local ids -> [n, F] uint64 ranks."""
        return self.kernel.apply(local, inverse=True)


class SyntheticCTR:
    """Synthetic CTR data with Zipf ids and labels drawn from a planted model.

    num_categorical, num_numeric: field counts (26 and 13, as in Criteo).
    vocab: ids per categorical field, an int or one int per field (default 10^7).
    zipf_a: the power-law exponent of id frequencies (> 0; 1.1 by default: the most
        frequent id of a 10^7 field has about 8% of the mass, the top 1% of ids 85%).
    seed: any non-negative int; the whole data set, planted model included, is a
        function of it.

    Every method returns a dict of numpy arrays: "categorical" int64 [n, F] (global
    ids, field f's in [offsets[f], offsets[f] + vocab[f])), "numeric" float32 [n, D]
    and "label" float32 [n] in {0, 1}.
    """

    def __init__(self, num_categorical: int = 26, num_numeric: int = 13,
                 vocab: int | tuple[int, ...] = 10**7, zipf_a: float = 1.1, seed: int = 0):
        if not isinstance(num_categorical, int) or num_categorical < 1:
            raise InvalidArgumentError(
                f"num_categorical must be an int >= 1, got {num_categorical!r}")
        if not isinstance(num_numeric, int) or num_numeric < 0:
            raise InvalidArgumentError(f"num_numeric must be an int >= 0, got {num_numeric!r}")
        if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
            raise InvalidArgumentError(f"seed must be a non-negative int, got {seed!r}")
        vocab_arr = np.asarray(vocab)
        if (vocab_arr.dtype.kind not in "iu" or vocab_arr.shape not in ((), (num_categorical,))
                or (vocab_arr < 1).any()):
            raise InvalidArgumentError(
                f"vocab must be a positive int or {num_categorical} of them, got {vocab!r}")
        vocab_arr = np.broadcast_to(vocab_arr, (num_categorical,))
        sizes = vocab_arr.astype(np.int64)
        if int(sizes.astype(object).sum()) >= 2**62:
            raise InvalidArgumentError(f"vocab sums to {int(sizes.astype(object).sum())}: "
                                       "the id space must stay below 2^62")
        zipf_a = float(zipf_a)
        if not zipf_a > 0 or not math.isfinite(zipf_a):
            raise InvalidArgumentError(f"zipf_a must be > 0, got {zipf_a}")

        self.num_categorical, self.num_numeric = num_categorical, num_numeric
        self.zipf_a, self.seed = zipf_a, seed
        self.vocab = sizes.copy()
        self.offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        self.total_vocab = int(sizes.sum())
        self.vocab.flags.writeable = self.offsets.flags.writeable = False

        # Zipf inverse CDF: rank = floor((1 + u * c)^(1 / (1 - a))) - 1, c = (V+1)^(1-a) - 1
        # (a == 1: rank = floor(exp(u * log(V + 1))) - 1); u from the field's hash.
        log_v1 = np.log(sizes.astype(np.float64) + 1.0)
        self._log_uniform = abs(1.0 - zipf_a) < 1e-9
        self._zipf_c = log_v1 if self._log_uniform else np.expm1((1.0 - zipf_a) * log_v1)
        self._perm = _Permutation(seed, sizes)

        nf, nd = num_categorical, num_numeric
        nchan = nf + nd + 1            # per sample: one hash per field, per number, label
        self._sample_keys = np.array(
            [[_key(seed, _TAG_SAMPLE, s, c) for c in range(nchan)] for s in range(3)],
            np.uint64)

        def uniforms(tag, n, k):
            return _unit(np.array([_key(seed, tag, j, k) for j in range(n)], np.uint64))

        # The planted model (module docstring); csrc/synth/kv_synth.c computes its logit.
        importance = 0.2 + 0.8 * uniforms(_TAG_FIELD, nf, 0)   # some fields matter more
        importance /= np.sqrt(np.mean(importance**2))
        w_scale = importance * (_WEIGHT_SCALE / math.sqrt(nf))
        # a 16-bit part p becomes the weight (p / 2^16 * 2 - 1) * sqrt(3) * w_scale
        self._w_mul = (w_scale * (2.0 * math.sqrt(3.0) / 2**16)).astype(np.float32)
        self._w_sub = (w_scale * math.sqrt(3.0)).astype(np.float32)
        npairs = max(1, nf * (nf - 1) // 2)
        # <v_f, v_g> has std |v_f||v_g| ~ s_f s_g sqrt(dim); sum over pairs ~ sqrt(npairs).
        v_scale = np.sqrt(importance) * math.sqrt(_VECTOR_SCALE / math.sqrt(npairs * _VECTOR_DIM))
        # a 12-bit part p becomes (p / 2^12 * 2 - 1) * sqrt(3) * v_scale
        self._v_mul = (v_scale * (2.0 * math.sqrt(3.0) / 2**12)).astype(np.float32)
        self._v_sub = (v_scale * math.sqrt(3.0)).astype(np.float32)
        self._mu = (3.0 * uniforms(_TAG_NUMERIC, nd, 0)).astype(np.float32)
        self._sigma = (0.5 + uniforms(_TAG_NUMERIC, nd, 1)).astype(np.float32)
        self._center = np.log1p(np.exp(self._mu))
        beta = 2.0 * uniforms(_TAG_NUMERIC, nd, 2) - 1.0
        # scale beta so that the numeric term's std is about _NUMERIC_SCALE
        spread = math.sqrt(np.sum((beta * self._sigma.astype(np.float64)) ** 2))
        beta *= _NUMERIC_SCALE / max(1e-9, spread)
        self._beta = beta.astype(np.float32)
        self._param_keys = np.array([_key(seed, _TAG_PARAM, f) for f in range(nf)], np.uint64)
        self._bias = self._calibrate_bias(self._kernel(0.0))
        self._model = self._kernel(self._bias)

    def __repr__(self):
        v = self.vocab[0] if (self.vocab == self.vocab[0]).all() else tuple(self.vocab.tolist())
        return (f"SyntheticCTR(num_categorical={self.num_categorical}, "
                f"num_numeric={self.num_numeric}, vocab={v}, zipf_a={self.zipf_a}, "
                f"seed={self.seed})")

    # ---- samples ------------------------------------------------------------------

    def samples(self, lo: int, hi: int, stream: str = TRAIN) -> dict:
        """Global samples lo, ..., hi-1 of a stream ("train" or "eval")."""
        if stream not in _STREAMS:
            raise InvalidArgumentError(f"stream must be 'train' or 'eval', got {stream!r}")
        lo, hi = int(lo), int(hi)
        if not 0 <= lo <= hi < 2**63:
            raise InvalidArgumentError(f"need 0 <= lo <= hi < 2^63, got lo={lo}, hi={hi}")
        out, _ = self._model.samples(self._sample_keys[_STREAMS[stream]], lo, hi - lo)
        return out

    def batch(self, step: int, global_batch_size: int, rank: int = 0, world: int = 1) -> dict:
        """This rank's slice of the global batch of `step`.

        The global batch is training samples [step * B, (step + 1) * B); rank r gets
        its `even_split` part, so the ranks' slices, concatenated in rank order, are the
        world=1 batch exactly.
        """
        step, b = int(step), int(global_batch_size)
        if step < 0 or b < 1:
            raise InvalidArgumentError(
                f"need step >= 0 and global_batch_size >= 1, got step={step}, "
                f"global_batch_size={b}")
        lo, hi = even_split(b, rank, world)
        return self.samples(step * b + lo, step * b + hi)

    def batches(self, global_batch_size: int, rank: int = 0, world: int = 1,
                start_step: int = 0, num_steps: int | None = None, *,
                prefetch: int = 0) -> SyntheticBatches:
        """`batch(step, ...)` for step = start_step, start_step + 1, ... (endless if
        num_steps is None): a source with kvcoll.data.position's protocol. Each
        iteration is a pass over those steps; `next()` continues a default pass.
        `resume(position)` starts the next pass at the step after a position (from
        `position_at`), on any world size: a step's global batch never depends on it."""
        return SyntheticBatches(self, global_batch_size, rank, world, start_step, num_steps,
                                prefetch)

    def eval_set(self, n: int, rank: int = 0, world: int = 1, offset: int = 0) -> dict:
        """Evaluation samples offset, ..., offset+n-1 (this rank's even_split part).

        They come from the "eval" stream, disjoint from every training sample.
        """
        n, offset = int(n), int(offset)
        if n < 0 or offset < 0:
            raise InvalidArgumentError(f"need n >= 0 and offset >= 0, got n={n}, offset={offset}")
        lo, hi = even_split(n, rank, world)
        return self.samples(offset + lo, offset + hi, stream=EVAL)

    # ---- planted model ------------------------------------------------------------

    def planted_logit(self, batch: dict) -> np.ndarray:
        """The ground-truth logit (float64 [n]) the labels of `batch` were drawn from."""
        ranks = self._ranks(batch)
        num = np.asarray(batch["numeric"])
        if num.shape != (ranks.shape[0], self.num_numeric):
            raise InvalidArgumentError(
                f"batch['numeric'] must be [{ranks.shape[0]}, {self.num_numeric}], "
                f"got {num.shape}")
        return self._model.logit(ranks, num.astype(np.float32, copy=False))

    def planted_probability(self, batch: dict) -> np.ndarray:
        """sigmoid(planted_logit(batch)): the true click probability of each sample."""
        return _sigmoid(self.planted_logit(batch))

    def planted_auc(self, batch: dict | int = 50_000) -> float:
        """The AUC of the planted model on `batch` (or on the first n eval samples):
        the best AUC any model can reach there."""
        if not isinstance(batch, dict):
            batch = self.eval_set(int(batch))
        return auc(batch["label"], self.planted_logit(batch))

    def id_rank(self, batch: dict) -> np.ndarray:
        """The frequency rank (0 = most frequent) of every id of `batch`, int64 [n, F]."""
        return self._ranks(batch).view(np.int64)

    # ---- internals ----------------------------------------------------------------

    def _ranks(self, batch: dict) -> np.ndarray:
        """The ranks (uint64 [n, F]) behind batch["categorical"], checked to be ours."""
        cat = np.asarray(batch["categorical"])
        if cat.ndim != 2 or cat.shape[1] != self.num_categorical or cat.dtype.kind not in "iu":
            raise InvalidArgumentError(
                f"batch['categorical'] must be integer [n, {self.num_categorical}], "
                f"got {cat.dtype} {cat.shape}")
        local = cat.astype(np.int64) - self.offsets
        bad = (local < 0) | (local >= self.vocab)
        if bad.any():
            r, f = map(int, np.argwhere(bad)[0])
            lo, hi = int(self.offsets[f]), int(self.offsets[f] + self.vocab[f])
            raise InvalidArgumentError(
                f"batch['categorical'][{r}, {f}] = {int(cat[r, f])} is not an id of field {f} "
                f"(expected [{lo}, {hi})); was the batch made by this SyntheticCTR?")
        return self._perm.inverse(local.view(np.uint64))

    def _kernel(self, bias: float) -> SynthModel:
        """The C generator with this data set's parameters and the given bias."""
        return SynthModel(
            self._perm.kernel, num_numeric=self.num_numeric, log_uniform=self._log_uniform,
            zipf_exponent=1.0 if self._log_uniform else 1.0 / (1.0 - self.zipf_a),
            zipf_c=self._zipf_c, offsets=self.offsets, param_keys=self._param_keys,
            w_mul=self._w_mul, w_sub=self._w_sub, v_mul=self._v_mul, v_sub=self._v_sub,
            mu=self._mu, sigma=self._sigma, center=self._center, beta=self._beta, bias=bias)

    def _calibrate_bias(self, model: SynthModel) -> float:
        """The bias that makes the mean click probability _TARGET_CTR, found by bisection
        on a fixed sample of a stream of its own (so it is a function of the settings);
        `model` is the planted model with bias 0."""
        _, logit = model.samples(self._sample_keys[_CALIBRATION_STREAM], 0, 8192, logit=True)
        lo, hi = -20.0, 20.0
        for _ in range(60):
            mid = 0.5 * (lo + hi)
            if _sigmoid(logit + mid).mean() < _TARGET_CTR:
                lo = mid
            else:
                hi = mid
        return 0.5 * (lo + hi)


class SyntheticBatches(Positioned):
    """SyntheticCTR's training batches of steps [start_step, start_step + num_steps), a
    data source (kvcoll.data.position): see `SyntheticCTR.batches`.

    Its position is global: {"rows": s * B} after step s - 1 (the global rows done),
    the same on every rank. `fit_batches(features)` and `dataset(features)` give
    (features, label) pairs for model.fit; `features` maps a batch dict to the model's
    inputs (default: {"C1".."CF": field ids, "numeric": the numbers}).
    """

    kind = "synthetic"
    split = "global"

    def __init__(self, data: SyntheticCTR, global_batch_size, rank, world, start_step,
                 num_steps, prefetch):
        from ._reader import rank_world

        b = int(global_batch_size)
        if b < 1 or int(start_step) < 0 or (num_steps is not None and int(num_steps) < 0) \
                or int(prefetch) < 0:
            raise InvalidArgumentError(
                f"synthetic batches: need global_batch_size >= 1, start_step >= 0, num_steps "
                f"None or >= 0 and prefetch >= 0, got {global_batch_size}, {start_step}, "
                f"{num_steps}, {prefetch}")
        self.data, self.batch_size = data, b
        self.rank, self.world = rank_world(rank, world)
        self.start_step = int(start_step)
        self.end_step = None if num_steps is None else self.start_step + int(num_steps)
        self.prefetch = int(prefetch)
        self.fingerprint = repr(data)
        self._default = None
        self._init_positions()

    def __repr__(self):
        return (f"SyntheticBatches({self.data!r}, global_batch_size={self.batch_size}, "
                f"rank={self.rank}, world={self.world}, steps {self.start_step}.."
                f"{'' if self.end_step is None else self.end_step})")

    def _start_position(self, fields) -> dict:
        step = self.start_step if fields is None else fields
        return self._position(data=self.fingerprint, batch_size=self.batch_size,
                              rows=step * self.batch_size)

    def _accept(self, position: dict) -> int:
        if position.get("data") != self.fingerprint:
            raise PositionError(f"synthetic: resume: the position was taken on "
                                f"{position.get('data')}, this is {self.fingerprint}")
        rows = self._need(position, "rows")
        if rows < 0 or rows % self.batch_size:
            raise PositionError(f"synthetic: resume: global row {rows} is not a whole number of "
                                f"batches of {self.batch_size}: resume with the batch size it "
                                f"was taken with ({position.get('batch_size')})")
        return rows // self.batch_size

    def _pass(self, first, log) -> Iterator[dict]:
        step = self.start_step if first is None else first
        if first is not None and self.end_step is not None and step >= self.end_step:
            step = self.start_step                # resumed at the end: a full pass follows
            log.restart(self._start_position(None))
        while self.end_step is None or step < self.end_step:
            batch = self.data.batch(step, self.batch_size, self.rank, self.world)
            step += 1
            log.record(self._start_position(step))
            yield batch

    def __iter__(self):
        from ._prefetch import Prefetch

        first, log = self._begin()
        return Prefetch(self._pass(first, log), self.prefetch, name="kvcoll-synthetic")

    def __next__(self) -> dict:
        if self._default is None:
            self._default = iter(self)
        return next(self._default)

    def features(self, batch: dict) -> dict:
        """The default model inputs of a batch: {"C1".."CF": int64 [n], "numeric"}."""
        cat = batch["categorical"]
        out = {f"C{f + 1}": np.ascontiguousarray(cat[:, f]) for f in range(cat.shape[1])}
        out["numeric"] = batch["numeric"]
        return out

    def fit_batches(self, features=None):
        """One pass as (features, label) pairs (an iterator `source_of` traces back)."""
        from ._reader import FitBatches

        features = features or self.features
        return FitBatches(self, lambda b: (features(b), b["label"]))

    def dataset(self, features=None):
        """A tf.data.Dataset of (features, label), one pass per iteration; its signature
        comes from `features` applied to a one-sample batch."""
        import tensorflow as tf

        from ._reader import source_dataset

        features = features or self.features
        probe = features(self.data.samples(0, 1))

        def spec(v):
            v = np.asarray(v)
            return tf.TensorSpec([None, *v.shape[1:]], tf.as_dtype(v.dtype))

        signature = ({k: spec(v) for k, v in probe.items()}, tf.TensorSpec([None], tf.float32))

        def gen():
            yield from self.fit_batches(features)

        return source_dataset(self, gen, signature)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * x))


def auc(labels, scores) -> float:
    """The area under the ROC curve: P(score of a positive > score of a negative),
    ties counting one half. Rank-based (Mann-Whitney U), O(n log n).

    labels: 0/1 (or bool) array; scores: any real array of the same length.
    """
    y = np.asarray(labels).ravel()
    s = np.asarray(scores, dtype=np.float64).ravel()
    if y.shape != s.shape:
        raise InvalidArgumentError(f"labels and scores differ in length: {y.size} vs {s.size}")
    if np.isnan(s).any():
        raise InvalidArgumentError("scores contain NaN")
    pos = y.astype(bool)
    if not np.array_equal(pos, y):
        raise InvalidArgumentError("labels must be 0 or 1")
    n_pos = int(pos.sum())
    n_neg = y.size - n_pos
    if n_pos == 0 or n_neg == 0:
        raise InvalidArgumentError(
            f"AUC needs both classes, got {n_pos} positives and {n_neg} negatives")
    _, inverse, counts = np.unique(s, return_inverse=True, return_counts=True)
    ends = np.cumsum(counts)
    mid_rank = ends - (counts - 1) / 2.0          # 1-based average rank of each tie group
    rank_sum = mid_rank[inverse][pos].sum()
    return float((rank_sum - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))
