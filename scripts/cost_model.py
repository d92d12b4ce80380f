"""What a run costs in bytes and egress dollars: volunteers x model size x publish interval.

    python scripts/cost_model.py                      # the table of docs/SCALE.md
    python scripts/cost_model.py --volunteers 500 --params 1.7e9 --publish-seconds 30

Pure arithmetic, no I/O: a model of `--params` parameters published in bf16 (2 bytes each)
every `--publish-seconds`; every volunteer follows every version. Without patches each one
downloads the whole weights file per version. With patches a volunteer that follows along
downloads one patch per version (`--patch-ratio`: the whole file's bytes over a patch's, as
`python -m bench.patch_size` measures it) and a keyframe only when it joins or falls behind
(`--rejoins-per-hour` each); the trainer uploads one patch per version and a keyframe every
`--keyframe-every` versions. Prices are per GB (10^9 bytes) of egress from the bucket to the
internet; upload into a bucket is free on S3 and on zero-egress stores, where the egress
column costs $0 and what remains is storage (about $0.015 per GB-month) and requests.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

GB = 1e9

# Published list prices, first tier, as of 2026: check your provider's page before planning.
S3_EGRESS_PER_GB = 0.09
"""AWS S3 data transfer out to the internet, first 10 TB a month (us-east-1); later tiers are
cheaper (down to $0.05), so for big runs the dollars here are an upper bound. A zero-egress
S3-compatible store (Cloudflare R2) charges nothing for these bytes."""
PATCH_RATIO = 66.0
"""Whole file / patch at lr 1e-6 on a Qwen3-0.6B shape (bench/patch_size.py, 2026-11-24; 14 at
lr 1e-5, 3 for the demo's tiny model at lr 3e-4)."""


@dataclass(frozen=True)
class Plan:
    volunteers: int
    params: float
    publish_seconds: float
    patch_ratio: float = PATCH_RATIO
    keyframe_every: int = 20
    rejoins_per_hour: float = 1.0
    bytes_per_param: int = 2

    @property
    def file_bytes(self) -> float:
        return self.params * self.bytes_per_param

    @property
    def versions_per_hour(self) -> float:
        return 3600 / self.publish_seconds

    def egress_full(self) -> float:
        """Bytes a hour leaving the bucket, whole files to every volunteer."""
        return self.volunteers * self.versions_per_hour * self.file_bytes

    def egress_patches(self) -> float:
        """Bytes a hour leaving the bucket with patches: one per version per volunteer, plus a
        keyframe per rejoin (a volunteer catching up takes patches or the keyframe, whichever
        is fewer bytes; the keyframe is the upper bound)."""
        patch = self.file_bytes / self.patch_ratio
        return self.volunteers * (self.versions_per_hour * patch + self.rejoins_per_hour * self.file_bytes)

    def downlink_full(self) -> float:
        """Bytes per second a volunteer must download to keep up: a whole file per interval."""
        return self.file_bytes / self.publish_seconds

    def downlink_patches(self) -> float:
        return self.file_bytes / self.patch_ratio / self.publish_seconds

    def uplink_full(self) -> float:
        """Bytes per second the trainer must upload: one whole file per publish interval."""
        return self.file_bytes / self.publish_seconds

    def uplink_patches(self) -> float:
        """A patch per version and a keyframe every keyframe_every versions."""
        return (self.file_bytes / self.patch_ratio + self.file_bytes / self.keyframe_every) / self.publish_seconds


def row(p: Plan) -> str:
    full, patches = p.egress_full(), p.egress_patches()
    return (f"| {p.volunteers:,} | {p.params / 1e9:g} B ({p.file_bytes / GB:.2f} GB) | "
            f"{p.publish_seconds:g} s | {full / GB:,.0f} GB, ${full / GB * S3_EGRESS_PER_GB:,.0f} | "
            f"{patches / GB:,.1f} GB, ${patches / GB * S3_EGRESS_PER_GB:,.2f} | "
            f"{p.uplink_full() * 8 / 1e6:,.0f} / {p.uplink_patches() * 8 / 1e6:,.1f} Mbit/s | "
            f"{p.downlink_full() * 8 / 1e6:,.0f} / {p.downlink_patches() * 8 / 1e6:,.1f} Mbit/s |")


HEADER = ("| volunteers | model (bf16 file) | publish every | per hour, whole files: egress, S3 $ | "
          "per hour, patches: egress, S3 $ | trainer uplink, whole / patches | "
          "each volunteer's downlink, whole / patches |\n|---|---|---|---|---|---|---|")

TABLE = [Plan(v, n, s) for v in (10, 100, 1000) for n in (0.6e9, 7e9) for s in (30, 300)]
"""The grid docs/SCALE.md shows."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--volunteers", type=int, help="volunteers following every version")
    parser.add_argument("--params", type=float, help="model parameters, e.g. 6e8")
    parser.add_argument("--publish-seconds", type=float, help="seconds between versions")
    parser.add_argument("--patch-ratio", type=float, default=PATCH_RATIO,
                        help=f"whole file / patch bytes ({PATCH_RATIO:g}: lr 1e-6, bench/patch_size.py)")
    parser.add_argument("--keyframe-every", type=int, default=20, help="versions between keyframes")
    parser.add_argument("--rejoins-per-hour", type=float, default=1.0,
                        help="keyframes each volunteer fetches an hour (joins, restarts, falling behind)")
    args = parser.parse_args()
    given = (args.volunteers, args.params, args.publish_seconds)
    if any(x is not None for x in given) and not all(x is not None for x in given):
        parser.error("give --volunteers, --params and --publish-seconds together (or none: the table)")
    plans = TABLE if given[0] is None else [Plan(args.volunteers, args.params, args.publish_seconds,
                                                 args.patch_ratio, args.keyframe_every,
                                                 args.rejoins_per_hour)]
    print(f"S3 egress ${S3_EGRESS_PER_GB}/GB; patch ratio {plans[0].patch_ratio:g}x; keyframe every "
          f"{plans[0].keyframe_every} versions; {plans[0].rejoins_per_hour:g} keyframe per volunteer-hour")
    print(HEADER)
    for p in plans:
        print(row(p))


if __name__ == "__main__":
    main()
