"""`collab models`: provision the embedded model (engines/model.py) and show what this machine
serves it with: the engines that import, dtype "auto" as measured here (engines/calibrate.py, for
every engine and for `collab serve`'s share of the cores) and the engine `auto` picks
(engines/engine_race.py: cached, or raced now with `--race`, again if cached). Run at install: it calibrates, so a
person's first `make run` measures no GEMMs; the engine race runs in the background of the first
`collab serve` and never delays the page."""
from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from collab_app.engines.model import MANIFEST, ModelError, sha256, ensure_model


def _engines_available() -> dict[str, str]:
    """Which engine backends import here ("ok" or the import error)."""
    out = {}
    for name, mods in (("transformers", ("torch", "transformers", "peft")), ("vllm", ("vllm",))):
        try:
            for m in mods:
                __import__(m)
            out[name] = "ok"
        except Exception as e:  # noqa: BLE001 - report, do not crash `collab models`
            out[name] = f"{type(e).__name__}: {e}"
    return out


def _dtype_info() -> dict:
    """What dtype "auto" resolves to here, on the device "auto" resolves to (cuda > mps > cpu: the
    trainer's and the transformers engine's, trainer/dtypes.py), and the CPU capability."""
    from trainer.dtypes import cpu_capability, resolve_dtype
    from trainer.dtypes import resolve_device

    device = resolve_device("auto")
    return {"device": device, "dtype": resolve_dtype("auto", device), "cpu_capability": cpu_capability()}


def serve_engine_threads() -> int | None:
    """The threads `collab serve`'s engine gets beside its trainer child on this machine (its
    default core split, cores.plan); None where serve splits nothing (one core, a GPU)."""
    from collab_app.cpu.cores import plan

    split = plan()
    return len(split.engine) if split else None


def cli_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="collab models", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="HF id or local folder (default: env COLLAB_MODEL, else embedded SmolLM2)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--no-engines", action="store_true", help="skip the engine import check (vllm import takes ~10 s)")
    p.add_argument("--race", action="store_true",
                   help="also race the engines on this machine now, again where a race is cached (engines/engine_race.py, "
                        "a few minutes on a quiet machine; else `collab serve` races them in the background at its "
                        "first start)")
    p.add_argument("--calibrate", action="store_true",
                   help="measure this CPU's base-GEMM precisions again (engines/calibrate.py; else the cached result)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        path = Path(ensure_model(args.model))
    except ModelError as e:
        print(f"collab models: {e}", file=sys.stderr)
        return 1
    st = path / "model.safetensors"
    manifest = path / MANIFEST
    info = {
        "path": str(path),
        "sha256": json.loads(manifest.read_text())["files"].get(st.name) if manifest.exists()
        else (sha256(st) if st.exists() else None),
        "engines": {} if args.no_engines else _engines_available(),
        **_dtype_info(),
    }
    if info["device"] == "cpu" and path.is_dir():
        from collab_app.engines.calibrate import calibrate
        from collab_app.engines.platform import auto_candidates

        # what the CPU engines' dtype "auto" serves in on this machine (measured, cached), per
        # engine: vLLM's GEMMs and the transformers engine's differ (engines/calibrate.py); where
        # vLLM is not installed, the transformers engine's alone. `collab serve` with its trainer
        # child builds its engine on its share of the cores (cores.plan), a calibration key of
        # its own: measured here too, so that the first `make run` does not measure it while a
        # person waits for the page.
        threads = serve_engine_threads()
        kinds = tuple(k for k in auto_candidates() if k in ("vllm", "transformers"))   # vLLM first where it is installed
        for engine in kinds:
            suffix = "_transformers" if engine != kinds[0] else ""
            try:
                cal = info["calibration" + suffix] = calibrate(str(path), refresh=args.calibrate, engine=engine)
            except Exception as e:  # noqa: BLE001 - report, do not fail the listing
                cal = info["calibration" + suffix] = {"error": f"{type(e).__name__}: {e}"}
            if threads and threads != cal.get("threads"):
                try:
                    info["calibration_serve" + suffix] = calibrate(str(path), threads=threads, refresh=args.calibrate,
                                                                   engine=engine)
                except Exception as e:  # noqa: BLE001 - as above
                    info["calibration_serve" + suffix] = {"error": f"{type(e).__name__}: {e}"}
        if "dtype" in info["calibration"]:
            info["dtype"] = info["calibration"]["dtype"] + (f"+{info['calibration']['quantize']}" if info["calibration"]["quantize"] else "")
        if not args.no_engines and info["engines"].get("vllm") == "ok":
            from collab_app.engines.choose import auto_choice
            if args.race:
                from collab_app.engines import engine_race

                engine_race.race(str(path), refresh=True)
            order, why = auto_choice(str(path))
            info["engine_auto"] = {"engine": order[0], "why": why}
    if args.json:
        print(json.dumps(info))
    else:
        print(f"model   {info['path']}\nsha256  {info['sha256']}")
        print(f"dtype   {info['dtype']} (auto on {info['device']}; CPU capability {info['cpu_capability']})")
        serve = " (collab serve's engine cores beside its trainer)"
        for key, where in (("calibration", ""), ("calibration_serve", serve)):
            for suffix in ("", "_transformers"):
                cal = info.get(key + suffix)
                if cal:
                    gemms = "the transformers engine's" if cal.get("engine") == "transformers" else "vLLM's"
                    print(f"measured {cal.get('measured_at', '')} on {cal.get('cpu', '?')}, {cal.get('threads', '?')} threads, "
                          f"{gemms} GEMMs{where}: {cal.get('why') or cal.get('error')}")
        for name, status in info["engines"].items():
            print(f"engine  {name:<12} {status}")
        if "engine_auto" in info:
            print(f"engine  auto         {info['engine_auto']['engine']} ({info['engine_auto']['why']})")
    return 0
