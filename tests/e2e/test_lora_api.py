"""LoRA adapters through HTTP on a real server (the shared one): adapters added to a tenant at run time by the
admin API, picked by the request's ``model`` with the official SDKs, listed by ``/v1/models``, their prefixes
cached apart from the base model's and from each other's, their usage counted per adapter, and bad input refused
with the problem named."""

from __future__ import annotations

import time

import anthropic
import httpx
import openai
import pytest
import torch

from harness import ACME_KEY, ADMIN_KEY, SHARED_INITECH_KEY, oa

TENANT = "initech"  # explicit: every reused token is reported
# About 100 tokens: six full blocks of 16 ahead of the question.
SYSTEM = "You are the LoRA test assistant. " + " ".join(f"Rule {i}: answer in plain words." for i in range(12))


def _admin(server, method: str, path: str, **kw) -> httpx.Response:
    return httpx.request(
        method, f"{server.base}/admin/v1{path}", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=60, **kw
    )


@pytest.fixture(scope="module")
def adapter_folders(demo_path, tmp_path_factory):
    """Two PEFT adapters of the demo model with random weights (rank 8 on attention, rank 4 on everything)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("adapters")
    folders = {}
    for i, (name, r, targets) in enumerate(
        [
            ("sql", 8, ["q_proj", "k_proj", "v_proj", "o_proj"]),
            ("poet", 4, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
        ]
    ):
        torch.manual_seed(7 + i)
        model = AutoModelForCausalLM.from_pretrained(str(demo_path), dtype=torch.float32)
        peft = get_peft_model(model, LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets, init_lora_weights=False))
        peft.save_pretrained(str(out / name))
        folders[name] = out / name
    return folders


_USED: list = []  # the server the adapters were added to (removed again after the module)


@pytest.fixture(scope="module", autouse=True)
def _remove_adapters(adapter_folders):
    yield
    for server in _USED[:1]:
        for name in adapter_folders:
            _admin(server, "DELETE", f"/tenants/{TENANT}/adapters/{name}")


@pytest.fixture()
def with_adapters(shared_server, adapter_folders):
    """The shared server with ``sql`` and ``poet`` added to initech (a PUT of the same folder changes nothing)."""
    for name, folder in adapter_folders.items():
        r = _admin(shared_server, "PUT", f"/tenants/{TENANT}/adapters/{name}", json={"path": str(folder)})
        assert r.status_code == 200, r.text
    _USED.append(shared_server)
    client = oa(shared_server, TENANT, SHARED_INITECH_KEY)
    deadline = time.monotonic() + 10
    while {"sql", "poet"} - {m.id for m in client.models.list().data}:  # every gateway replica within a second
        assert time.monotonic() < deadline, "the adapters never showed in /v1/models"
        time.sleep(0.1)
    return shared_server


def _ask(client: openai.OpenAI, model: str, question: str):
    return client.chat.completions.create(
        model=model,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        max_tokens=8,
        temperature=0,
    )


def test_models_lists_the_tenants_adapters_with_their_base(with_adapters):
    models = {m.id: m for m in oa(with_adapters, TENANT, SHARED_INITECH_KEY).models.list().data}
    assert set(models) == {"demo", "sql", "poet"}
    assert models["sql"].model_extra.get("parent") == "demo" and models["demo"].model_extra.get("parent") is None
    # Another tenant does not see them.
    assert [m.id for m in oa(with_adapters).models.list().data] == ["demo"]
    r = httpx.get(
        f"{with_adapters.base}/{TENANT}/v1beta/models", headers={"x-goog-api-key": SHARED_INITECH_KEY}, timeout=60
    )
    names = {m["name"]: m for m in r.json()["models"]}
    assert set(names) == {"models/demo", "models/sql", "models/poet"}
    assert names["models/sql"]["baseModelId"] == "demo"


def test_a_prefix_is_cached_per_adapter_and_never_across(with_adapters):
    client = oa(with_adapters, TENANT, SHARED_INITECH_KEY)
    question = f"Which table holds the orders? ({time.time_ns()})"  # after the shared system prompt

    def cached(model: str) -> int:
        return _ask(client, model, question).usage.prompt_tokens_details.cached_tokens

    first = cached("sql")
    assert cached("sql") > first  # its own prefix again: a hit
    for other in ("poet", "demo"):  # the same tokens under another adapter or the base model: never its blocks
        assert cached(other) <= first, other
    assert cached("sql") > first  # and under sql again: still a hit


def test_an_adapter_changes_the_answer_and_anthropics_sdk_picks_it_too(with_adapters):
    client = oa(with_adapters, TENANT, SHARED_INITECH_KEY)
    question = "Name three colours."
    base = _ask(client, "demo", question).choices[0].message.content
    sql = _ask(client, "sql", question).choices[0].message.content
    assert base != sql  # random adapter weights: another greedy answer
    assert _ask(client, "sql", question).choices[0].message.content == sql  # and the same one each time
    an = anthropic.Anthropic(
        base_url=f"{with_adapters.base}/{TENANT}", api_key=SHARED_INITECH_KEY, max_retries=0, timeout=120
    )
    msg = an.messages.create(
        model="sql",
        max_tokens=8,
        system=SYSTEM,
        messages=[{"role": "user", "content": question}],
        extra_body={"temperature": 0},
    )
    assert msg.content[0].text == sql  # the same rendered prompt under the same adapter: the same greedy answer
    assert an.messages.count_tokens(model="poet", messages=[{"role": "user", "content": "hi"}]).input_tokens > 0


def test_usage_is_counted_per_adapter(with_adapters):
    def usage() -> dict:
        r = httpx.get(f"{with_adapters.base}/{TENANT}/v1/usage", headers={"x-api-key": SHARED_INITECH_KEY}, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()

    before = usage()["adapters"]["poet"]["usage"].get("requests", 0)
    _ask(oa(with_adapters, TENANT, SHARED_INITECH_KEY), "poet", "Write one line.")
    deadline = time.monotonic() + 10
    while usage()["adapters"]["poet"]["usage"].get("requests", 0) != before + 1:
        assert time.monotonic() < deadline, "the adapter's usage never counted the request"
        time.sleep(0.2)


def test_bad_adapters_and_names_are_refused_naming_them(with_adapters, tmp_path):
    client = oa(with_adapters, TENANT, SHARED_INITECH_KEY)
    with pytest.raises(openai.NotFoundError) as exc:
        _ask(client, "nope", "hi")
    assert "'nope'" in str(exc.value) and "'sql'" in str(exc.value)
    with pytest.raises(openai.NotFoundError):  # another tenant's adapter
        _ask(oa(with_adapters, "acme", ACME_KEY), "sql", "hi")
    r = _admin(with_adapters, "PUT", f"/tenants/{TENANT}/adapters/ghost", json={"path": str(tmp_path / "none")})
    assert r.status_code == 422 and "adapters.ghost" in r.text and "does not exist" in r.text
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "adapter_config.json").write_text("{not json")
    (tmp_path / "bad" / "adapter_model.safetensors").write_bytes(b"")
    r = _admin(with_adapters, "PUT", f"/tenants/{TENANT}/adapters/bad", json={"path": str(tmp_path / "bad")})
    assert r.status_code == 422 and "not valid JSON" in r.text
    r = _admin(with_adapters, "PUT", f"/tenants/{TENANT}/adapters/demo", json={"path": str(tmp_path / "bad")})
    assert r.status_code == 422 and "base model" in r.text
    assert _admin(with_adapters, "DELETE", f"/tenants/{TENANT}/adapters/ghost").status_code == 404
    # Nothing of that changed what the tenant serves.
    assert {m.id for m in client.models.list().data} == {"demo", "sql", "poet"}
    assert _ask(client, "sql", "hi").choices[0].message.content is not None
