"""Row (d) of issue 42, run by bench.catch_up in its run, on the model it trained: with LoRA,
what a volunteer fetches to catch up, how long a new version takes to reach its sampler
merged into the weights or held unmerged, how fast each form samples, and whether the
trainer's replay of those honest groups ever rejects one on this 151,936-token vocabulary.

The trainer's side is what `vrl trainer --lora-rank 1 --weights-dtype bf16` publishes: the
model wrapped on every linear layer (model.lora.add_adapters, alpha 32), its frozen base
rounded to bf16 (model.lora.round_frozen), v1 published whole (the base, a keyframe), v2 and
v3 each its adapter only, after one AdamW step on the adapters at lr LR (LoRA's default:
ten times full fine-tuning's). The objects go into the moto server bench.catch_up started,
under their own prefix, and are read through the same shared link.

The volunteer's side, a fresh fp32 model as a volunteer's:
- new: it holds nothing and moves to v3 as `Volunteer.switch` does: the base's keyframe
  (chain.fetch_weights) copied into the model, then v3's adapter, checked and held unmerged
  in PEFT's layers (chain.onto_version). Baseline: the full run's keyframe in
  bench.catch_up's run.
- behind: it holds v2 and moves to v3: the base is held, only v3's adapter is fetched. A
  LoRA version names one adapter on the base, never the versions between, so this is what
  any number of versions behind costs. Baseline: the full run's one patch, and its five and
  twenty in the note.
- unmerged against merged, the same move v2 -> v3: unmerged (what volunteers run) keeps the
  PEFT-wrapped model whose base never changes and writes only the adapter's A and B; merged
  (the rule before 2026-11-30) copies the held base file into the model again and adds each
  layer's B @ A (lora.load_adapter). Then each form samples the same committed-noise groups
  (PROMPTS prompts, K completions of NEW tokens, the manifest's temperature), best of two.
- replay: the groups the volunteer sampled are replayed as the trainer replays v3 (the base
  under PEFT's layers holding the published adapter, lora.load_adapter_unmerged) at the
  trainer's --replay-tolerance; honest completions rejected (goal 0), and how far the
  replay's margins are from each sampler's at the same positions (0 for the volunteer's
  form: the same computation; the merged form rounds otherwise).
"""

from __future__ import annotations

import time
from pathlib import Path

from bench.common import Row

RANK = 1
ALPHA = 32.0
LR = 3e-3  # TrainerConfig's LR times LORA_LR_FACTOR: the default `vrl trainer --lora-rank` takes
PROMPTS, K, NEW = 4, 4, 16
PREFIX = "lora"


def publish_lora(policy, folder: Path, work: Path) -> list:
    """Wrap `policy`'s model (in place) and publish v1 (the base) and v2, v3 (adapters) to
    `folder`, as a LoRA trainer does; the manifests by version, index 0 unused."""
    import torch

    from bench.checkpoint_sync import Publisher
    from bench.patch_size import calculator_steps
    from volunteer_rl.model.lora import LoraSpec, add_adapters, round_frozen
    from volunteer_rl.model.policy import Policy

    model = add_adapters(policy.model, LoraSpec(RANK, ALPHA))
    round_frozen(model, torch.bfloat16)
    wrapped = Policy(model, policy.tokenizer, policy.prompt_format, policy.device)
    pub = Publisher(str(folder), None, wrapped, "bf16", work, lora_rank=RANK)
    pub.cfg.lora_alpha = ALPHA
    manifests = [None]
    steps = calculator_steps(wrapped, LR)
    for v in (1, 2, 3):
        if v > 1:
            loss, step_s = next(steps)
            print(f"LoRA step: loss {loss:.3f} in {step_s:.0f} s", flush=True)
        t0 = time.perf_counter()
        pub.publish()
        manifests.append(pub.manifest)
        what = "base, whole" if pub.manifest.adapter is None else "adapter"
        print(f"LoRA v{v}: {what}, published in {time.perf_counter() - t0:.1f} s", flush=True)
    steps.close()
    return manifests


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def honest_groups(policy, prompts, m):
    """Committed-noise groups of `prompts` under version `m`, as a volunteer samples them;
    (seconds, completions, keys, tokens)."""
    from volunteer_rl.model.sampling import sample
    from volunteer_rl.protocol.draws import group_keys

    keys = [group_keys(m.run_id, m.version, "bench-vol", g, g, K, "bench") for g in range(len(prompts))]
    sec, groups = timed(lambda: sample(policy, prompts, K, m.sampling.temperature, NEW,
                                       draw_keys=keys))
    comps = [[s.token_ids for s in g] for g in groups]
    return sec, comps, keys, sum(len(c) for g in comps for c in g)


def lora_rows(policy, tmp: Path, direct_uri: str, endpoint: str, link: str, quick: bool,
              full: dict) -> list[Row]:
    """The rows, measured after bench.catch_up's: `full` holds that run's figures (keyframe
    seconds and bytes, and seconds and bytes by versions behind), `direct_uri` and `endpoint`
    reach the moto server directly (to upload), `link` through the shared link."""
    from bench.catch_up import COMMAND, MBPS, upload_target
    from bench.checkpoint_sync import policy_for, qwen3
    from bench.replay_choice import TOL, margin_gap
    from volunteer_rl.config import PACKAGE_DATA
    from volunteer_rl.model.chain import Held, fetch_weights, onto_version, swap_weights
    from volunteer_rl.model.lora import LoraSpec, add_adapters, load_adapter, load_adapter_unmerged
    from volunteer_rl.model.policy import encode_prompts
    from volunteer_rl.model.replay import replay
    from volunteer_rl.model.vetting import WEIGHTS_FILE
    from volunteer_rl.protocol.manifest import ADAPTER_FILE
    from volunteer_rl.storage import open_storage
    from volunteer_rl.storage.s3 import S3Storage
    from volunteer_rl.task.dataset import load_csv

    folder = tmp / "lora-bucket"
    m = publish_lora(policy, folder, tmp / "lora-work")
    direct = S3Storage(f"{direct_uri}/{PREFIX}", endpoint_url=endpoint)
    for v in (1, 2, 3):
        upload_target(folder, m[v], direct)
    remote = open_storage(f"{direct_uri}/{PREFIX}", link)
    local = open_storage(str(folder))
    adapter_bytes = m[3].files[ADAPTER_FILE].size

    # The volunteer, as Volunteer.switch moves it: fetch_weights, then chain.onto_version.
    state = {"policy": policy_for(qwen3(quick)), "root": None, "held": None}

    def move(to) -> object:
        fetched = fetch_weights(remote, to, state["held"], print)
        state["held"] = Held(to.run_id, to.version, to.files[WEIGHTS_FILE].root, fetched.buf)
        state["policy"], state["root"] = onto_version(remote, to, state["policy"], fetched.buf,
                                                      state["root"])
        return fetched

    new_s, got = timed(lambda: move(m[3]))
    if got.how != "keyframe":
        raise SystemExit(f"a new LoRA volunteer fetched {got.how}")
    print(f"LoRA new volunteer: {(got.bytes + adapter_bytes) / 1e6:.0f} MB in {new_s:.1f} s", flush=True)
    behind = []
    for _ in range(2):  # v2, then v3: what any number of versions behind costs
        move(m[2])
        sec, fetched = timed(lambda: move(m[3]))
        if fetched.how != "held":
            raise SystemExit(f"a LoRA volunteer on the base fetched {fetched.how}")
        behind.append(sec)
    vol = state["policy"]
    unmerged_s = min(behind)

    merged = policy_for(qwen3(quick))  # the rule before: the base copied again, deltas added
    held = Held(m[2].run_id, m[2].version, m[2].files[WEIGHTS_FILE].root,
                swap_weights(local, m[2], merged, None).buf)
    load_adapter(local, m[2], merged.model)

    def merged_move():
        swap_weights(remote, m[3], merged, held, print)
        load_adapter(remote, m[3], merged.model)

    merged_s = min(timed(merged_move)[0] for _ in range(2))
    print(f"LoRA move v2 -> v3: volunteers (unmerged) {unmerged_s:.2f} s, merged {merged_s:.2f} s",
          flush=True)

    problems = load_csv(PACKAGE_DATA / "train.csv")[:PROMPTS]
    prompts = encode_prompts(vol, [p.prompt for p in problems])
    speed, sampled = {}, {}
    for form, p in (("unmerged", vol), ("merged", merged), ("unmerged", vol), ("merged", merged)):
        sec, comps, keys, tokens = honest_groups(p, prompts, m[3])
        speed[form] = max(speed.get(form, 0.0), tokens / sec)
        sampled[form] = (comps, keys)
        print(f"LoRA sampling {form}: {tokens} tokens in {sec:.1f} s", flush=True)
    # The trainer's replay of v3: the base, PEFT's layers holding the published adapter.
    trainer = policy_for(qwen3(quick))
    swap_weights(local, m[1], trainer, None)
    trainer.model = add_adapters(trainer.model, LoraSpec(RANK, ALPHA)).eval()
    load_adapter_unmerged(local, m[3], trainer.model)
    temperature = m[3].sampling.temperature

    def replayed(p, form):  # `form`'s samples replayed by `p`
        return replay(p, prompts, *sampled[form], temperature)

    by_trainer = replayed(trainer, "unmerged")
    lost = sum(r.first_failure(TOL) != -1 for r in by_trainer)
    worst = min(x for r in by_trainer for x in r.margins)
    gaps = {"unmerged": margin_gap(by_trainer, replayed(vol, "unmerged")),
            "merged": margin_gap(replayed(trainer, "merged"), replayed(merged, "merged"))}
    print(f"LoRA replay: {lost} rejected, worst margin {worst:.2e}; margin gaps {gaps}", flush=True)

    shape = "small Qwen3" if quick else "Qwen3-0.6B shape"
    cmd = COMMAND + (" --quick" if quick else "")
    link_text = f"moto over HTTP through one {MBPS} MB/s link shared by every connection"
    one_patch_s, one_patch_b = full["behind"][1]
    others = ", ".join(f"{n} patches {sec:.1f} s ({b:,} bytes)"
                       for n, (sec, b) in full["behind"].items() if n > 1)
    return [
        Row(f"LoRA rank {RANK}: a new volunteer, {MBPS} MB/s link",
            "seconds to the new weights (base + adapter vs full run's keyframe)",
            new_s, full["keyframe_s"], full["keyframe_s"] / new_s, "-", None, cmd,
            f"{got.bytes:,}-byte bf16 base + {adapter_bytes:,}-byte adapter vs the full run's "
            f"{full['keyframe_bytes']:,}-byte keyframe; both verified and loaded into the live "
            f"model; {link_text}; {shape}"),
        Row(f"LoRA rank {RANK}: a volunteer any number of versions behind, {MBPS} MB/s link",
            "seconds to the new weights (adapter vs the full run's 1 patch)",
            unmerged_s, one_patch_s, one_patch_s / unmerged_s, "-", None, cmd,
            f"{adapter_bytes:,} bytes (one adapter; the base held) vs {one_patch_b:,} bytes in "
            f"1 patch; the full run's {others}; the adapter held unmerged, as volunteers do "
            f"(best of 2); {link_text}; {shape}"),
        Row(f"LoRA rank {RANK}: a new version to sampling, unmerged vs merged",
            "seconds from a manifest to sampling with it (unmerged vs merged)",
            unmerged_s, merged_s, merged_s / unmerged_s, "-", None, cmd,
            f"unmerged (volunteers): PEFT's layers on the base held once, a version writes only "
            f"its A and B; merged (the rule before): the held base copied into the model again "
            f"and each layer's B @ A added; both fetch and check the {adapter_bytes:,}-byte "
            f"adapter over the link; best of 2; {shape}"),
        Row(f"LoRA rank {RANK}: sampling speed, unmerged vs merged",
            "completion tokens/s (unmerged vs merged)",
            speed["unmerged"], speed["merged"], speed["unmerged"] / speed["merged"], "-", None, cmd,
            f"{PROMPTS} prompts x {K} committed-noise completions x {NEW} tokens, temperature "
            f"{m[3].sampling.temperature:g}, fp32 on the bf16 base, best of 2; {shape}"),
        Row(f"LoRA rank {RANK}: honest completions the replay rejects",
            "completions rejected (a volunteer's, replayed by the trainer)",
            lost, 0, 1.0, "0", lost == 0, cmd,
            f"{PROMPTS * K} completions sampled as volunteers do (unmerged), replayed as the "
            f"trainer does (PEFT, the published adapter); worst margin {worst:+.2e} nats; the "
            f"replay's margins differ from the sampler's by {gaps['unmerged']:.1e} nats (merged "
            f"sampler: {gaps['merged']:.1e}); {shape}, vocabulary "
            f"{vol.model.config.vocab_size:,}"),
    ]
