"""jaxtrain's model behind lm-eval's `LM` interface: loglikelihood, loglikelihood_rolling and
generate_until on a model's live parameters, batched and compiled.

What a request means is lm-eval's: the text is tokenized as its Hugging Face backend (HFLM)
tokenizes it (a context and its continuation encoded together and split, an empty context
conditioned on the BOS token, else EOS), a row too long for the model keeps its last
`max_length` tokens, and a rolling log-likelihood is split into lm-eval's disjoint windows.
So a score from this adapter means what lm-eval's own scoring of the same model means;
tests/evaluation/test_lm_eval_tasks.py holds every request's answer to HFLM's through
transformers (log-likelihoods within 1e-4 relative, generations and scores equal).

The model's side is jaxtrain's: log-likelihoods come from one compiled step over batches of
`batch_size` requests (scoring.py), generations from the serving engine (continuous
batching, a paged KV cache; serving/engine.py), stop strings cut there as HFLM cuts them.
`update(model)` points both at new parameters (the next evaluation of a training run)
without compiling anything again.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from flax import nnx
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from jaxtrain.errors import TaskError
from jaxtrain.evaluation.scoring import Scorer
from jaxtrain.serving import Engine, SamplingParams

__all__ = ["JaxLM"]

# Generation settings the engine honours; anything else in a task's generation_kwargs is
# refused rather than ignored (it would change what the score means).
GENERATION_KEYS = ("until", "max_gen_toks", "do_sample", "temperature", "top_p", "top_k")
DEFAULT_MAX_LENGTH = 2048  # lm-eval's, when neither the model nor the tokenizer says


class JaxLM(TemplateLM):
    """An NNX causal LM (with its tokenizer) as an lm-eval model.

    `batch_size`: requests per compiled step and sequences decoded at once; `max_length`:
    the model's context (default its max_position_embeddings); `sharding(ndim)`: where a
    batch's arrays go (the run's batch layout), None = beside the model; `add_bos_token`:
    as HFLM's (None: the tokenizer's own default).
    """

    def __init__(
        self,
        model: nnx.Module,
        tokenizer: Any,
        *,
        batch_size: int = 8,
        max_length: int | None = None,
        max_gen_toks: int = 256,
        sharding: Any = None,
        add_bos_token: bool | None = None,
    ):
        super().__init__()
        if tokenizer is None:
            raise TaskError("evaluating lm-eval tasks needs the model's tokenizer.")
        self.tokenizer, self.add_bos_token = tokenizer, add_bos_token
        self.batch_size, self._max_gen_toks = batch_size, max_gen_toks
        self._max_length = max_length or _context_length(model, tokenizer)
        graphdef, self.state = nnx.split(model)
        self.model = model
        self.scorer = Scorer(graphdef, rows=batch_size, max_length=self._max_length,
                             sharding=sharding)  # fmt: skip
        self.engine: Engine | None = None  # made at the first generate_until

    def update(self, model: nnx.Module) -> None:
        """Score and generate with `model`'s parameters from now on (same structure)."""
        self.model, self.state = model, nnx.split(model)[1]
        if self.engine is not None:
            self.engine.update_state(self.state)

    # ------------------------------------------------------------ lm-eval's interface
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        """What an empty context is conditioned on: BOS, else EOS (as HFLM)."""
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def tokenizer_name(self) -> str:
        return getattr(self.tokenizer, "name_or_path", "jaxtrain").replace("/", "__")

    def tok_encode(
        self, string: str, add_special_tokens: bool | None = None, left_truncate_len=None, **kw
    ) -> list[int]:
        """HFLM's encoding: special tokens by the flag, else by add_bos_token, else the
        tokenizer's default; none when the text already starts with the BOS token."""
        del kw
        if add_special_tokens is not None:
            options = {"add_special_tokens": add_special_tokens}
        elif self.add_bos_token is not None:
            options = {"add_special_tokens": self.add_bos_token}
        else:
            options = {}
        if add_special_tokens is None and string.startswith(
            self.tokenizer.decode(self.prefix_token_id)
        ):
            options["add_special_tokens"] = False
        ids = self.tokenizer.encode(string, **options)
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, tokens: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """lm-eval's tokenizing of (context, continuation) pairs (TemplateLM), quietly."""
        del disable_tqdm
        return super().loglikelihood(requests, disable_tqdm=True)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kw):
        """(log p(continuation | context), is greedy) of ((context, continuation), context
        ids, continuation ids) requests, in their order."""
        del disable_tqdm, kw
        rows = []
        for _, context, continuation in requests:
            if not continuation:
                raise TaskError("a loglikelihood request with an empty continuation.")
            # Too long for the model: keep the last max_length inputs (HFLM's rule).
            ids = (context + continuation)[-(self.max_length + 1) :][:-1]
            rows.append((ids, len(ids) - len(continuation), continuation))
        # Longest first: the rows of a batch are of similar length, so few pad.
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
        pad = self.tokenizer.pad_token_id
        pad = pad if pad is not None else self.eot_token_id
        scored = self.scorer(self.state, [rows[i] for i in order], pad)
        out: list[tuple[float, bool]] = [(0.0, False)] * len(rows)
        for i, result in zip(order, scored):
            out[i] = result
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each text's log-likelihood over lm-eval's disjoint windows of max_length tokens
        (the first conditioned on the prefix token)."""
        windows, owner = [], []
        for index, (text,) in enumerate(req.args for req in requests):
            pieces = get_rolling_token_windows(
                token_list=self.tok_encode(text),
                prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length,
                context_len=1,
            )
            for context, continuation in map(make_disjoint_window, pieces):
                windows.append(((None, None), context, continuation))
                owner.append(index)
        totals = [0.0] * len(requests)
        for index, (logp, _) in zip(owner, self._loglikelihood_tokens(windows)):
            totals[index] += logp
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Each context's generation, cut before the first stop string (`until`, and the
        EOS token's text), greedy unless the task samples."""
        eos = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        groups: dict[str, list[int]] = defaultdict(list)
        for index, req in enumerate(requests):
            groups[repr(sorted(req.args[1].items()))].append(index)
        out = [""] * len(requests)
        for indices in groups.values():
            context_ids, params = [], None
            for i in indices:
                context, gen_kwargs = requests[i].args
                if params is None:
                    params = self._sampling(gen_kwargs, eos)
                room = self.max_length - params.max_tokens
                ids = self.tok_encode(context, left_truncate_len=room) or [self.prefix_token_id]
                context_ids.append(ids)
            for i, completion in zip(indices, self._engine().generate(context_ids, params)):
                out[i] = completion[0].text
        return out

    # ------------------------------------------------------------ helpers
    def _sampling(self, gen_kwargs: dict[str, Any], eos: str) -> SamplingParams:
        unknown = sorted(set(gen_kwargs) - set(GENERATION_KEYS))
        if unknown:
            raise TaskError(
                f"generation_kwargs {unknown} are not supported by jaxtrain's engine (it "
                f"honours {', '.join(GENERATION_KEYS)}); remove them from the task."
            )
        kwargs = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
        until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
        if kwargs["max_gen_toks"] >= self.max_length:
            raise TaskError(
                f"max_gen_toks {kwargs['max_gen_toks']} leaves no room for a context in the "
                f"model's {self.max_length} tokens; lower it in the task's generation_kwargs."
            )
        sample = kwargs.get("do_sample") and kwargs.get("temperature", 0.0) > 0
        return SamplingParams(
            max_tokens=int(kwargs["max_gen_toks"]),
            temperature=float(kwargs["temperature"]) if sample else 0.0,
            top_p=float(kwargs.get("top_p") or 1.0),
            top_k=int(kwargs.get("top_k") or 0),
            stop=tuple(s for s in until if s),
        )

    def _engine(self) -> Engine:
        if self.engine is None:
            self.engine = Engine(self.model, tokenizer=self.tokenizer,
                                 max_slots=self.batch_size, max_length=self.max_length)  # fmt: skip
        return self.engine


def _context_length(model: nnx.Module, tokenizer: Any) -> int:
    """The model's context as lm-eval reads it: the config's, else the tokenizer's."""
    config = getattr(model, "config", None)
    for name in ("n_positions", "max_position_embeddings", "n_ctx"):
        value = getattr(config, name, None)
        if value:
            return int(value)
    limit = getattr(tokenizer, "model_max_length", None)
    if limit and limit < 10**12:
        return int(limit)
    return DEFAULT_MAX_LENGTH
