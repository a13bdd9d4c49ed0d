"""The distributed guide's launch recipes (docs/guides/distributed.md): each command names a shipped config that
tests/commands/test_cli.py fits through the real command on the processes the comment says, and the log line the
page shows is the optimizer's own wording."""

from __future__ import annotations

import re

from helpers import DOCS

PAGE = "guides/distributed.md"


def section() -> str:
    return (DOCS / PAGE).read_text().split("## Launch recipes\n", 1)[1].split("\n## ", 1)[0]


def recipes() -> list[tuple[str, str]]:
    (block,) = re.findall(r"```bash\n(.*?)```", section(), re.S)
    return [(line.split()[3], line.partition("#")[2].strip()) for line in block.strip().splitlines()]


def test_every_recipe_is_a_shipped_config_fitted_by_the_tests_on_its_processes():
    import commands.test_cli as cli_tests

    from lightning_muon.commands.config_files import merged_config, shipped_configs

    shipped = {config.name for config in shipped_configs()}
    fitted = {*cli_tests.DISTRIBUTED, *cli_tests.TENSOR_PARALLEL, "gpt_muon.yaml"}
    assert len(recipes()) == 5
    for config, comment in recipes():
        assert config in shipped and config in fitted, config
        devices = merged_config(config)["trainer"].get("devices", 1)
        said = re.search(r"(\d+) processes", comment)
        assert (int(said.group(1)) if said else 1) == devices, (config, comment)


def test_the_log_line_shown_is_the_optimizer_s_wording():
    from test_troubleshooting import found_in, source_texts

    (shown,) = re.findall(r"```text\n(.*?)```", section(), re.S)
    line = shown.strip()
    assert line.startswith("Muon: ") and line.endswith(".")  # optim/_choice.py: f"Muon: {description}."
    description = re.sub(r"over \d+ DDP ranks", "over ...", line.removeprefix("Muon: ").removesuffix("."))
    assert description != line and found_in(description, source_texts())
