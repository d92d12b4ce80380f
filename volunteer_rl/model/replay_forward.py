"""The replay's forward (model.replay): the logits that predict every token of the completions
to replay, each distinct prefix of a prompt's completions computed once.

A token's logits depend only on its prompt and the tokens before it, and the K completions of
a prompt share prefixes (a confident policy repeats itself: 32 groups of the demo's v0 held
2,186 completion tokens, 3,120 positions once padded, and 1,146 distinct prefixes). So the
completions of a prompt form a tree under it, and each node of the tree is run once: the
prompts in one pass whose KV cache is kept, then the nodes, packed into rows of at most the
longest completion's length, each row a subtree of one prompt's tree. A node's position id is
its depth after its prompt and the attention mask lets it see its prompt and its ancestors
only, so it computes what the sampler computed on its own path (up to float noise, the same
as any change of batch). A row is never wider than a padded completion, so the attention costs
no more than one row per completion would. Prompts run in runs of similar length (`by_length`),
so a short prompt is not padded to the longest of a batch.

Models whose attention is not set wholly by that mask and the position ids (TREE_MODEL_TYPES)
replay one padded row per distinct completion instead (model.scoring.completion_logits).
"""

from __future__ import annotations

from collections import Counter

import torch

from volunteer_rl.model.policy import Policy
from volunteer_rl.model.sampling import left_pad
from volunteer_rl.model.scoring import completion_logits

TREE_MODEL_TYPES = frozenset({"llama", "qwen2", "qwen3"})
"""Architectures replayed as prefix trees: rotary positions from the position ids, every layer
attending through the one mask it is given (no sliding window in use, no state carried along
the sequence), so a node placed anywhere in a row sees exactly its prompt and its ancestors.
Others (sliding windows, ALiBi, recurrent layers, or any not checked) take the padded rows."""

TREE_ATTENTION = frozenset({"sdpa", "eager"})
"""Attention implementations that take a custom 4-D mask (sdpa a boolean one, eager an
additive one)."""


def tree_ok(policy: Policy) -> bool:
    """Whether `policy`'s model can be replayed as prefix trees (TREE_MODEL_TYPES)."""
    config = policy.model.config
    return (config.model_type in TREE_MODEL_TYPES
            and getattr(config, "_attn_implementation", None) in TREE_ATTENTION
            and not getattr(config, "use_sliding_window", False))


CALL_POSITIONS = 32
"""What one more forward call costs, in positions run, when prompts are split by length
(`by_length`): a split costs two calls more, about 0.8 ms each for the demo's model on one
thread against about 25 us a position. A larger model pays relatively less for a call."""

SPLIT_SPAN = 64
"""The most distinct prompt lengths one split may span, which bounds `by_length`'s work."""


def replay_logits(policy: Policy, prompts: list[list[int]], completions: list[list[list[int]]]
                  ) -> tuple[torch.Tensor, list[list[int]]]:
    """The logits that predict each completion token given its prompt and the tokens before it.

    prompts: G prompts; completions: for each prompt its non-empty completions. Returns logits
    [N, V] in the model's dtype and, for each completion in group order, the row of those
    logits that predicts each of its tokens. Prompts of similar length run together
    (`by_length`), so short prompts are not padded to the longest."""
    forward = _tree_logits if tree_ok(policy) else _padded_logits
    parts, at = [], [[] for _ in prompts]
    offset = 0
    for part in by_length([len(p) for p in prompts]):
        logits, rows = forward(policy, [prompts[g] for g in part], [completions[g] for g in part])
        rows = iter(rows)
        for g in part:
            at[g] = [[offset + i for i in next(rows)] for _ in completions[g]]
        parts.append(logits)
        offset += len(logits)
    return (torch.cat(parts) if len(parts) > 1 else parts[0]), [r for rs in at for r in rs]


def by_length(lengths: list[int]) -> list[list[int]]:
    """The indices of `lengths`, split into runs of similar length: of the splits of the sorted
    lengths, the one that runs the fewest positions, counting each prompt padded to the longest
    of its run and CALL_POSITIONS a run (runs span at most SPLIT_SPAN distinct lengths)."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    count = Counter(lengths)
    distinct = sorted(count)
    below = [0]  # below[j]: how many prompts have one of the j shortest lengths
    for n in distinct:
        below.append(below[-1] + count[n])
    # best[j]: fewest positions for those prompts; cut[j]: where its last run starts
    best, cut = [0], [0]
    for j in range(1, len(distinct) + 1):
        cost, i = min((best[i] + (below[j] - below[i]) * distinct[j - 1] + CALL_POSITIONS, i)
                      for i in range(max(0, j - SPLIT_SPAN), j))
        best.append(cost)
        cut.append(i)
    runs, j = [], len(distinct)
    while j:
        runs.append(order[below[cut[j]]:below[j]])
        j = cut[j]
    return runs[::-1]


def _padded_logits(policy: Policy, prompts: list[list[int]], completions: list[list[list[int]]]
                   ) -> tuple[torch.Tensor, list[list[int]]]:
    """One padded row per distinct completion of a prompt: identical completions share their
    forward (only their noise differs)."""
    distinct: list[list[list[int]]] = []
    of_row: list[int] = []  # each completion's forward row
    index: dict[tuple[int, tuple[int, ...]], int] = {}
    for g, cs in enumerate(completions):
        distinct.append([])
        for tokens in cs:
            seen = (g, tuple(tokens))
            if seen not in index:
                index[seen] = len(index)
                distinct[-1].append(tokens)
            of_row.append(index[seen])
    logits, _, _ = completion_logits(policy, prompts, distinct)
    width = logits.shape[1]
    tokens = [c for cs in completions for c in cs]
    at = [[r * width + p for p in range(len(c))] for r, c in zip(of_row, tokens)]
    return logits.reshape(-1, logits.shape[-1]), at


class _Row:
    """One row of the node pass: a subtree of one prompt's completions."""

    def __init__(self, group: int):
        self.group = group
        self.tokens: list[int] = []  # each node's own token (the last of its prefix)
        self.parent: list[int] = []  # each node's parent column, -1 under the prompt
        self.depth: list[int] = []   # each node's prefix length (1 for a completion's first token)
        self.trie: dict = {}         # token -> (column, children)

    def shared(self, path: list[int]) -> int:
        """How many of `path`'s prefixes this row holds already (it holds every prefix of a
        node, so they are the first ones)."""
        level, n = self.trie, 0
        for t in path:
            if t not in level:
                break
            level, n = level[t][1], n + 1
        return n

    def add(self, path: list[int]) -> list[int]:
        """The columns of every prefix of `path`, its new nodes added."""
        level, parent, cols = self.trie, -1, []
        for t in path:
            if t not in level:
                level[t] = (len(self.tokens), {})
                self.tokens.append(t)
                self.parent.append(parent)
                self.depth.append(len(cols) + 1)
            parent, level = level[t][0], level[t][1]
            cols.append(parent)
        return cols


def _tree_logits(policy: Policy, prompts: list[list[int]], completions: list[list[list[int]]]
                 ) -> tuple[torch.Tensor, list[list[int]]]:
    """The prefix trees (see the module's docstring). Logit rows: the G prompts' last
    positions, then the node pass's rows x width."""
    model, dev, n_groups = policy.model, policy.device, len(prompts)
    # A completion's token at position p > 0 is predicted by the node of its prefix of length
    # p; its last token predicts nothing to replay, so a path is all but that token.
    width = max(1, max(len(c) for cs in completions for c in cs) - 1)
    rows: list[_Row] = []
    placed: list[tuple[int, list[int]]] = []  # each completion's (row, node columns)
    for g, cs in enumerate(completions):
        order = sorted(range(len(cs)), key=cs.__getitem__)  # shared prefixes side by side
        where: dict[int, tuple[int, list[int]]] = {}
        row = None
        for i in order:
            path = cs[i][:-1]
            if not path:
                where[i] = (-1, [])
                continue
            if row is None or len(row.tokens) + len(path) - row.shared(path) > width:
                row = _Row(g)
                rows.append(row)
            where[i] = (len(rows) - 1, row.add(path))
        placed += [where[i] for i in range(len(cs))]
    groups = [g for g, cs in enumerate(completions) for _ in cs]
    p_ids, p_mask = left_pad(prompts, policy.pad_id, dev)
    p_pos = (p_mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=p_ids, attention_mask=p_mask, position_ids=p_pos, use_cache=True,
                logits_to_keep=1)
    parts = [out.logits[:, -1]]
    if rows:
        parts.append(_node_pass(policy, rows, width, out.past_key_values, p_mask, p_pos))
    logits = torch.cat(parts) if len(parts) > 1 else parts[0]
    at = [[g] + [n_groups + r * width + c for c in cols]
          for g, (r, cols) in zip(groups, placed)]
    return logits, at


def _node_pass(policy: Policy, rows: list[_Row], width: int, cache, p_mask: torch.Tensor,
               p_pos: torch.Tensor) -> torch.Tensor:
    """The node rows after their prompts' cache: logits [rows * width, V]."""
    dev = policy.device
    n = len(rows)
    ids = torch.full((n, width), policy.pad_id, dtype=torch.long)
    depth = torch.zeros((n, width), dtype=torch.long)
    parent = torch.full((n, width), -1, dtype=torch.long)
    for r, row in enumerate(rows):
        k = len(row.tokens)
        ids[r, :k] = torch.tensor(row.tokens, dtype=torch.long)
        depth[r, :k] = torch.tensor(row.depth, dtype=torch.long)
        parent[r, :k] = torch.tensor(row.parent, dtype=torch.long)
    # ancestors[r, j, a]: node a is node j or one of its ancestors (columns past a row's
    # nodes see only themselves and their prompt; their logits are never read)
    ancestors = torch.eye(width, dtype=torch.bool).repeat(n, 1, 1)
    up, rix, cix = parent.clone(), torch.arange(n)[:, None], torch.arange(width)[None, :]
    while bool((up >= 0).any()):
        ok = up >= 0
        ancestors[rix.expand_as(up)[ok], cix.expand_as(up)[ok], up[ok]] = True
        up = torch.where(ok, parent.gather(1, up.clamp(min=0)), up)
    group = torch.tensor([row.group for row in rows], dtype=torch.long, device=dev)
    cache.batch_select_indices(group)
    prompt_part = p_mask[group].bool()[:, None, :].expand(n, width, -1)
    mask = torch.cat([prompt_part, ancestors.to(dev)], dim=2)[:, None]
    if policy.model.config._attn_implementation != "sdpa":  # eager adds its mask
        mask = torch.zeros(mask.shape, dtype=policy.model.dtype, device=dev).masked_fill_(
            ~mask, torch.finfo(policy.model.dtype).min)
    positions = p_pos[group, -1:] + depth.to(dev)
    logits = policy.model(input_ids=ids.to(dev), attention_mask=mask, position_ids=positions,
                          past_key_values=cache).logits
    return logits.reshape(n * width, -1)
