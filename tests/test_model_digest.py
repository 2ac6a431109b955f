"""One model per cluster, named by its weights (common/model_digest.py), not by where a worker keeps it.

The gateway pinned the first worker's model path: a worker with the same model at another path (another host's
mount) was refused, and one whose directory at that path held other weights (a fine-tune, a revision copied over)
was taken, its jobs answered by another model than their neighbours', marked done.

Real parts: copies of the tiny model built by scripts/make_tiny_model.py (one with one weight changed, saved with
safetensors), a real gateway process and real worker processes; raw hellos where an older worker's is needed.
"""

from __future__ import annotations

import json
import shutil
import struct
import time
import uuid
import zipfile

import pytest
import zmq

from common import protocol as P
from common.model_digest import of_weights
from common.redis_server import RedisServer
from common.sockets import make_socket
from gateway.hello_policy import HelloPolicy
from gateway.sdk import GatewayClient
from tests.cluster_helpers import stop_process, wait_for
from tests.test_tokenizer_match import _Gateway, _worker


@pytest.fixture(scope="module")
def copies(tiny_model_dir, tmp_path_factory):
    """The tiny model at two other paths, one of them saved again with another `_name_or_path`; and a copy with
    one weight changed (a fine-tune's), and one with a config value changed."""
    import torch
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("model-copies")
    out = {name: root / name / "tiny" for name in ("a", "b", "tuned", "config")}
    for path in out.values():
        shutil.copytree(tiny_model_dir, path)
    config = json.loads((out["b"] / "config.json").read_text())
    (out["b"] / "config.json").write_text(json.dumps(config | {"_name_or_path": "/elsewhere/tiny"}, indent=1))
    (weights,) = out["tuned"].glob("*.safetensors")
    tensors = load_file(weights)
    name = sorted(tensors)[len(tensors) // 2]
    tensors[name] = tensors[name] + torch.full_like(tensors[name], 1e-3)
    save_file(tensors, weights, metadata={"format": "pt"})
    config = json.loads((out["config"] / "config.json").read_text())
    (out["config"] / "config.json").write_text(json.dumps(config | {"rms_norm_eps": 1e-3}))
    return out


def test_the_digest_names_the_weights_not_the_path(tiny_model_dir, copies, tmp_path):
    same = of_weights(str(tiny_model_dir))
    assert same is not None and same.startswith("sha256t:")
    assert of_weights(str(copies["a"])) == of_weights(str(copies["b"])) == same
    assert of_weights(str(copies["tuned"])) != same
    assert of_weights(str(copies["config"])) != same
    assert of_weights("some-org/some-model") is None  # a hub name: its path still names it
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    assert of_weights(str(empty)) is None  # no weights to read
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, broken)
    (weights,) = broken.glob("*.safetensors")
    weights.write_bytes((10**12).to_bytes(8, "little") + b"{}")  # a header longer than the file
    assert of_weights(str(broken)) is None
    # torch.save's zip with its directory or an entry's header broken: nothing to name it by, not a crash.
    import torch

    weights.unlink()
    torch.save({"w": torch.ones(4)}, broken / "pytorch_model.bin")
    whole = (broken / "pytorch_model.bin").read_bytes()
    assert of_weights(str(broken)) is not None
    for signature in (b"PK\x01\x02", b"PK\x03\x04"):  # the central directory's first entry; the first local header
        at = whole.index(signature)
        (broken / "pytorch_model.bin").write_bytes(whole[:at] + b"\0" * 4 + whole[at + 4:])
        assert of_weights(str(broken)) is None, signature


def _tensor_places(weights) -> list[tuple[str, int, int]]:
    """(name, first byte, end) of each tensor's data in the weight file ``weights``: a safetensors file, or
    torch.save's zip (a tensor's storage an entry of its own, after its local header)."""
    with weights.open("rb") as f:
        if weights.suffix == ".safetensors":
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
            return [(name, 8 + header_len + t["data_offsets"][0], 8 + header_len + t["data_offsets"][1])
                    for name, t in header.items() if name != "__metadata__"]
        with zipfile.ZipFile(weights) as z:
            storages = [i for i in z.infolist() if "/data/" in i.filename]
        places = []
        for info in storages:
            f.seek(info.header_offset + 26)
            name_len, extra_len = struct.unpack("<HH", f.read(4))
            begin = info.header_offset + 30 + name_len + extra_len
            places.append((info.filename, begin, begin + info.file_size))
        return places


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_a_fine_tune_of_any_one_tensor_changes_the_digest(bench_model_dir, tmp_path, fmt):
    """A fine-tune that leaves most tensors as they were (layers frozen, a LoRA merged into a few projections) is
    other weights. Bytes sampled at 16 places across a file missed most of a 32M-parameter model's tensors (64 KiB
    each of 128 MiB): a copy with any one of them tuned was named as the model, and taken beside it. ``bin``: the
    model saved as torch.save saves it (pytorch_model.bin, a zip)."""
    import numpy as np

    model = tmp_path / "bench"
    shutil.copytree(bench_model_dir, model)
    if fmt == "bin":
        import torch
        from safetensors.torch import load_file

        (safetensors,) = model.glob("*.safetensors")
        torch.save(load_file(safetensors), model / "pytorch_model.bin")
        safetensors.unlink()
    original = of_weights(str(model))
    (weights,) = model.glob(f"*.{fmt}")
    places = _tensor_places(weights)
    assert len(places) > 16 and weights.stat().st_size > 64 * 2**20, "a model too small to show it"
    data = np.memmap(weights, dtype=np.uint8, mode="r+")
    missed = []
    for name, begin, end in places:
        kept = data[begin:end].copy()
        tensor = data[begin:end].view(np.float32)
        tensor += np.float32(1e-3)  # every weight of this tensor tuned, no other
        data.flush()
        if of_weights(str(model)) == original:
            missed.append(name)
        data[begin:end] = kept
        data.flush()
    del data
    assert of_weights(str(model)) == original, "the copy was not put back"
    assert not missed, f"{len(missed)} of {len(places)} tensors tuned alone kept the digest: {missed[:5]}"


def _hello(worker_id: str, model: str, digest: str | None) -> P.WorkerHello:
    return P.WorkerHello(worker_id, model, 512, 2048, 4, 512, weights_digest=digest)


def test_the_policy_compares_digests_where_both_say_one_and_paths_where_not():
    d, e = "sha256:" + "d" * 64, "sha256:" + "e" * 64
    policy = HelloPolicy()
    first = _hello("wk-1", "/mnt/a/tiny", d)
    assert policy.refusal(first) is None
    policy.pin(first)
    assert policy.refusal(_hello("wk-2", "/srv/b/tiny", d)) is None  # the same weights elsewhere
    other = policy.refusal(_hello("wk-3", "/mnt/a/tiny", e))  # other weights at the same path
    assert other is not None and "weights" in other and "/mnt/a/tiny" in other, other
    assert policy.refusal(_hello("wk-old", "/srv/b/tiny", None)) is not None  # no digest: its path decides
    assert policy.refusal(_hello("wk-old", "/mnt/a/tiny", None)) is None
    # A cluster an older worker pinned (no digest) compares paths, and learns the digest of the first that says one.
    older = HelloPolicy()
    older.pin(_hello("wk-old", "/mnt/a/tiny", None))
    assert older.refusal(_hello("wk-2", "/srv/b/tiny", d)) is not None
    older.pin(_hello("wk-1", "/mnt/a/tiny", d))
    assert older.refusal(_hello("wk-3", "/mnt/a/tiny", e)) is not None


def test_digests_of_two_schemes_are_not_compared_and_each_scheme_pins_its_own():
    """Workers of two versions in one cluster (a rolling upgrade): their digests of one model differ by scheme
    ("sha256:" sampled no tensor; "sha256t:" does). Compared, every worker of the newer version was refused as other
    weights; now their paths decide, as for a worker that says no digest, and each scheme's first digest is pinned."""
    old, new, other = "sha256:" + "d" * 64, "sha256t:" + "e" * 64, "sha256t:" + "f" * 64
    policy = HelloPolicy()
    policy.pin(_hello("wk-old", "/mnt/a/tiny", old))
    assert policy.refusal(_hello("wk-1", "/mnt/a/tiny", new)) is None  # the same path: taken
    refused = policy.refusal(_hello("wk-2", "/srv/b/tiny", new))
    assert refused is not None and "model" in refused, refused  # another path, no digest to compare: refused
    policy.pin(_hello("wk-1", "/mnt/a/tiny", new))
    assert policy.refusal(_hello("wk-2", "/srv/b/tiny", new)) is None  # the newer scheme's digest names it now
    refused = policy.refusal(_hello("wk-3", "/mnt/a/tiny", other))
    assert refused is not None and "weights" in refused, refused
    assert policy.refusal(_hello("wk-old-2", "/srv/b/tiny", old)) is None  # the older scheme's, as before
    assert policy.refusal(_hello("wk-old-3", "/mnt/a/tiny", "sha256:" + "0" * 64)) is not None


def _raw_hello(endpoint: str, hello: P.WorkerHello):
    s = make_socket(zmq.Context.instance(), zmq.DEALER, identity=hello.worker_id.encode())
    s.setsockopt(zmq.LINGER, 0)
    s.connect(endpoint)
    try:
        s.send(P.encode(hello))
        assert s.poll(20_000), f"no answer to the hello of {hello.worker_id}"
        return P.decode(s.recv())
    finally:
        s.close()


def test_workers_of_one_model_at_two_paths_serve_together_and_other_weights_are_refused(tmp_path, copies):
    with RedisServer() as redis_server:
        gw = _Gateway(tmp_path, "gw-weights", redis_server.url, f"weights-{uuid.uuid4().hex[:8]}").started()
        procs = []
        try:
            for wid, path in (("wk-a", copies["a"]), ("wk-b", copies["b"]), ("wk-tuned", copies["tuned"])):
                procs.append(_worker(tmp_path, wid, path, gw.workers)[0])
                if wid == "wk-a":  # the first pins the cluster's model
                    with GatewayClient(gw.clients, gw.tenants["api-co"]["api_key"], timeout_s=30) as sdk:
                        wait_for(lambda: sdk.info().workers == ["wk-a"], 120, "the first worker")
            wait_for(lambda: "refused hello from wk-tuned" in gw.log.read_text(), 120, "the fine-tune's refusal")
            line = next(ln for ln in gw.log.read_text().splitlines() if "refused hello from wk-tuned" in ln)
            assert "weights" in line and str(copies["tuned"]) in line, line
            with GatewayClient(gw.clients, gw.tenants["api-co"]["api_key"], timeout_s=30) as sdk:
                wait_for(lambda: sorted(sdk.info().workers) == ["wk-a", "wk-b"], 120, "the copy at another path")
                jobs = [sdk.submit(prompt_token_ids=[3, 4, 5], max_tokens=8, ignore_eos=True) for _ in range(4)]
                results = [j.result(timeout=120).token_ids for j in jobs]
                assert all(r == results[0] and len(r) == 8 for r in results), results
                time.sleep(0.5)
                assert "wk-tuned" not in sdk.info().workers
            # An older worker (no digest) at another path than the cluster's is refused, as before.
            refused = _raw_hello(gw.workers, P.WorkerHello("wk-older", str(copies["b"]), 512, 2048, 4, 512))
            assert isinstance(refused, P.ErrorReply) and "model" in refused.message, refused
        finally:
            for proc in procs:
                stop_process(proc, timeout=30)
            gw.stop()
