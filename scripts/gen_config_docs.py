"""Render docs/configuration.md from the pydantic models, so the reference never drifts from the code.

python scripts/gen_config_docs.py          # rewrite docs/configuration.md
python scripts/gen_config_docs.py --check  # exit 1 if it is out of date
"""

from __future__ import annotations

import argparse
import inspect
import sys
from pathlib import Path

from pydantic import BaseModel

# This checkout's art_sglang, whether or not the package is installed.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from art_sglang.config import ClusterConfig, DeviceConfig, SGLangConfig, TrainerConfig
from art_sglang.training.options import TrainOptions

DOC = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"
HEADER = """# Configuration reference

Generated from the pydantic models by `python scripts/gen_config_docs.py`; do not edit by hand.
Every model rejects unknown fields, so a misspelt option is an error, not a silent default.
"""


def _default(model: type[BaseModel], name: str) -> str:
    field = model.model_fields[name]
    if name == "server_timeout":  # read from the environment when the model is built
        return "`600.0`, or env `ART_SERVER_TIMEOUT`"
    value = field.default_factory() if field.default_factory is not None else field.default  # type: ignore[call-arg]
    return f"`{value!r}`"


def render() -> str:
    parts = [HEADER]
    for model in (SGLangConfig, DeviceConfig, ClusterConfig, TrainerConfig, TrainOptions):
        parts.append(f"\n## {model.__name__}\n\n{inspect.cleandoc(model.__doc__ or '')}\n")
        parts.append("| field | type | default | meaning |\n|---|---|---|---|")
        for name, field in model.model_fields.items():
            annotation = (
                getattr(field.annotation, "__name__", None) if isinstance(field.annotation, type) else None
            )
            annotation = (annotation or str(field.annotation)).replace("typing.", "").replace("|", "\\|")
            parts.append(
                f"| `{name}` | `{annotation}` | {_default(model, name)} | {field.description or ''} |"
            )
        parts.append("")
    return "\n".join(parts)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--check", action="store_true", help="fail if docs/configuration.md is out of date")
    text = render()
    if parser.parse_args().check:
        if not DOC.exists() or DOC.read_text() != text:
            print(f"{DOC} is out of date: run python scripts/gen_config_docs.py", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(text)
    print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
