"""Build the blend benchmark corpus (documents.jsonl, chunks.jsonl, prompts.jsonl) and check it.

    python benchmarks/blend/data/build_corpus.py texts   [--work DIR]  # sources -> documents.jsonl + chunks.jsonl
    python benchmarks/blend/data/build_corpus.py prompts               # questions.jsonl -> prompts.jsonl
    python benchmarks/blend/data/build_corpus.py check   [--work DIR]  # validate everything (see README.md)

``texts`` needs a Debian (bookworm) machine: ``apt-get download`` (Debian's package mirror) fetches
the .deb files of ``manpages``, ``dict-jargon`` and ``r-cran-janeaustenr`` into DIR (nothing is
installed); the legal texts are ``/usr/share/common-licenses`` (package ``base-files``); man pages
are rendered with ``man`` + ``groff`` (packages ``man-db``, ``groff-base``). The rendering of man
pages depends on groff's version (1.22.4 here), so a rebuild elsewhere may differ in whitespace:
``check --work DIR`` reports such differences, and documents.jsonl is the reference. ``prompts`` and
``check`` need only ragkv and the local SmolLM2 tokenizer (``ragkv.models``), no network. DIR defaults
to /tmp/corpus-work/build.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import random
import re
import struct
import subprocess
import sys
import zlib
from pathlib import Path

DATA = Path(__file__).resolve().parent
CHUNK_TOKENS = 512  # ragkv's default chunk size (chunk_document's max_tokens)
MIN_CHUNK_TOKENS = 200  # shorter chunks (the tails of documents) are stored but not put in prompts
MAX_PROMPT_TOKENS = 3600
MIN_PROMPT_TOKENS = 1500
DEBS = ["manpages", "dict-jargon", "r-cran-janeaustenr"]

# The documents of each split, per genre. GFDL-1.2 is left out: it shares whole chunks with GFDL-1.3.
LEGAL = {  # /usr/share/common-licenses/<name> (base-files); Python's license file (libpython3.11-stdlib)
    "dev": ["GFDL-1.3", "MPL-1.1", "Artistic", "/usr/lib/python3.11/LICENSE.txt"],
    "test": ["Apache-2.0", "GPL-2", "GPL-3", "LGPL-2.1", "MPL-2.0", "CC0-1.0"],
}
MANPAGES = {  # Linux man-pages 6.03 (Debian package manpages)
    "dev": ["man7/pipe.7", "man7/hier.7", "man5/core.5", "man7/path_resolution.7"],
    "test": ["man7/epoll.7", "man7/inotify.7", "man7/signal.7", "man7/unix.7", "man7/credentials.7",
             "man7/mq_overview.7", "man7/symlink.7", "man7/pthreads.7"],
}
AUSTEN = {  # (novel, chapter index in the novel, 1-based)
    "dev": [("northangerabbey", 1), ("northangerabbey", 2), ("mansfieldpark", 1), ("mansfieldpark", 2)],
    "test": [("prideprejudice", 1), ("prideprejudice", 3), ("prideprejudice", 6), ("emma", 1), ("emma", 2),
             ("persuasion", 1), ("persuasion", 3), ("sensesensibility", 1), ("sensesensibility", 2)],
}
JARGON = {  # runs of consecutive entries of the Jargon File 4.4.7: (first headword, last headword)
    "dev": [("daemon", "deep magic"), ("hacker", "hacker humor"), ("pascal", "pathological")],
    "test": [("back door", "bang path"), ("bogo-sort", "bogus"), ("fencepost error", "film at 11"),
             ("kluge", "kremvax"), ("magic cookie", "magic smoke"), ("security through obscurity", "sex"),
             ("thunk", "tiger team")],
}
NOVELS = {"emma": "Emma", "mansfieldpark": "Mansfield Park", "northangerabbey": "Northanger Abbey",
          "persuasion": "Persuasion", "prideprejudice": "Pride and Prejudice",
          "sensesensibility": "Sense and Sensibility"}


def clean(text: str) -> str:
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").replace("\t", "    ").split("\n")]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


def read_jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def write_jsonl(path: Path, rows) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def template():
    from ragkv import models
    from ragkv.prompt import PromptTemplate

    if hasattr(models, "load_tokenizer"):  # no weights needed
        return PromptTemplate.for_tokenizer(models.load_tokenizer("smollm2-135m"))
    return PromptTemplate.for_tokenizer(models.load("smollm2-135m")[1])


# ---------------------------------------------------------------- sources

def fetch_debs(work: Path) -> Path:
    root = work / "root"
    if not (root / "usr/share/dictd/jargon.dict.dz").exists():
        debs = work / "debs"
        debs.mkdir(parents=True, exist_ok=True)
        subprocess.run(["apt-get", "download", *DEBS], cwd=debs, check=True)
        for deb in sorted(debs.glob("*.deb")):
            subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)
    return root


def legal_docs():
    for split, names in LEGAL.items():
        for name in names:
            if name.startswith("/"):  # Python's LICENSE.txt: history, PSF/BeOpen/CNRI/CWI licenses
                path, doc, pkg = Path(name), "python", "Debian libpython3.11-stdlib"
            else:
                path, doc, pkg = Path("/usr/share/common-licenses", name), name.lower().replace(".", ""), \
                    "Debian base-files"
            yield {"id": f"legal-{doc}", "genre": "legal", "split": split, "source": f"{path} ({pkg})",
                   "license": "license text, verbatim copying permitted", "text": clean(path.read_text(encoding="utf-8"))}


def man_docs(root: Path):
    for split, pages in MANPAGES.items():
        for page in pages:
            path = root / "usr/share/man" / f"{page}.gz"
            src = gzip.decompress(path.read_bytes()).decode("utf-8")
            m = re.search(r"SPDX-License-Identifier:\s*(\S+)|%%%LICENSE_START\((\w+)\)", src)
            lic = (m.group(1) or m.group(2)) if m else "see page source"
            env = {"MANWIDTH": "80", "LANG": "C.UTF-8", "PATH": "/usr/bin:/bin"}
            out = subprocess.run(["man", "--nh", "--nj", "-l", str(path)], env=env, check=True,
                                 capture_output=True, text=True).stdout
            text = subprocess.run(["col", "-bx"], input=out, check=True, capture_output=True, text=True).stdout
            lines = clean(text).split("\n")
            name = page.split("/")[1].rsplit(".", 1)
            title = f"{name[0]}({name[1]})"
            if lines and lines[0].lower().startswith(title.lower()):  # running header
                lines = lines[1:]
            if lines and lines[-1].startswith("Linux man-pages"):  # running footer
                lines = lines[:-1]
            lines = [re.sub(r"^ {1,7}", "", ln) for ln in lines]  # the page's 7-column left margin
            yield {"id": f"technical-{name[0].replace('_', '')}", "genre": "technical", "split": split,
                   "source": f"man page {title}, Linux man-pages 6.03 (Debian manpages 6.03-2), rendered "
                             "with man --nh --nj, MANWIDTH=80",
                   "license": f"man-pages license {lic} (redistributable)", "text": clean("\n".join(lines))}


def _rdb_vectors(path: Path) -> list[list[str]]:
    """Character vectors of an R lazy-load database (each block: 4-byte length + zlib(serialized STRSXP))."""
    data, pos, out = path.read_bytes(), 0, []
    while pos < len(data):
        d = zlib.decompressobj()
        raw = d.decompress(data[pos + 4:])
        pos = len(data) - len(d.unused_data)
        assert raw[:2] == b"X\n", "not an XDR R serialization"
        p = 14 + (4 + struct.unpack(">i", raw[14:18])[0] if struct.unpack(">i", raw[2:6])[0] == 3 else 0)
        flags, n = struct.unpack(">ii", raw[p:p + 8])
        assert flags & 0xFF == 16, "not a character vector"
        p += 8
        vec = []
        for _ in range(n):
            _, k = struct.unpack(">ii", raw[p:p + 8])
            p += 8
            vec.append("" if k < 0 else raw[p:p + k].decode("utf-8"))
            p += max(k, 0)
        out.append(vec)
    return out


def austen_docs(root: Path):
    novels = {}
    for vec in _rdb_vectors(root / "usr/lib/R/site-library/janeaustenr/data/Rdata.rdb"):
        key = next(k for k, v in NOVELS.items() if vec[0].strip().lower() == v.lower())
        novels[key] = vec
    for split, picks in AUSTEN.items():
        for novel, n in picks:
            lines = novels[novel]
            heads = [i for i, ln in enumerate(lines) if re.match(r"^chapter [0-9ivxlc]+$", ln.strip(), re.I)]
            end = heads[n] if n < len(heads) else len(lines)
            body = [ln for ln in lines[heads[n - 1]:end] if not re.match(r"^\s*VOLUME [IVX]+\s*$", ln)]
            yield {"id": f"literature-{novel}-ch{n:02d}", "genre": "literature", "split": split,
                   "source": f"Jane Austen, {NOVELS[novel]}, chapter {n} (R package janeaustenr 1.0.0, "
                             "Debian r-cran-janeaustenr, from Project Gutenberg)",
                   "license": "public domain (text); janeaustenr packaging MIT", "text": clean("\n".join(body))}


_B64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"


def _b64(s: str) -> int:
    n = 0
    for c in s:
        n = n * 64 + _B64.index(c)
    return n


def jargon_docs(root: Path):
    data = gzip.decompress((root / "usr/share/dictd/jargon.dict.dz").read_bytes())  # dictzip is gzip
    entries = []
    for line in (root / "usr/share/dictd/jargon.index").read_text(encoding="utf-8").splitlines():
        head, off, size = line.rstrip("\n").split("\t")
        if not head.startswith("00-database"):
            entries.append((_b64(off), _b64(size), head))
    entries.sort()
    heads = [h for _, _, h in entries]
    for split, ranges in JARGON.items():
        for first, last in ranges:
            parts = []
            for off, size, _ in entries[heads.index(first):heads.index(last) + 1]:
                raw = data[off:off + size].decode("utf-8")
                raw = re.sub(r"\{\s*([^{}]*?)\s*\}", lambda m: re.sub(r"\s+", " ", m.group(1)), raw)  # xrefs
                lines = raw.strip("\n").split("\n")
                body = [ln[4:] if ln.startswith("    ") else ln.strip() for ln in lines[1:]]
                parts.append(lines[0].strip() + "\n" + clean("\n".join(body)))
            slug = re.sub(r"[^a-z0-9]+", "", first.lower())
            yield {"id": f"encyclopedic-{slug}", "genre": "encyclopedic", "split": split,
                   "source": f"The Jargon File 4.4.7 (Debian dict-jargon), entries '{first}' to '{last}'",
                   "license": "public domain", "text": clean("\n\n".join(parts))}


def build_texts(work: Path) -> list[dict]:
    root = fetch_debs(work)
    return [*legal_docs(), *man_docs(root), *austen_docs(root), *jargon_docs(root)]


def chunk_docs(docs: list[dict], tpl) -> list[dict]:
    from ragkv.chunking import chunk_document

    rows = []
    for d in docs:
        for n, text in enumerate(chunk_document(d["text"], tpl, CHUNK_TOKENS)):
            rows.append({"id": f"{d['id']}-{n}", "genre": d["genre"], "doc": d["id"], "source": d["source"], "text": text})
    return rows


# ---------------------------------------------------------------- prompts

def _ntok(tpl, texts: list[str], question: str = "?") -> int:
    return tpl.build(question, texts).num_tokens


def features(prompts: list[dict], doc_of: dict) -> dict[str, list[str]]:
    """Feature tags of each prompt; 'reordered': one of its chunks is in another prompt at another
    position or after another neighbour."""
    seen = collections.defaultdict(set)  # chunk id -> {(prompt id, index, previous chunk id)}
    for p in prompts:
        for i, c in enumerate(p["chunks"]):
            seen[c].add((p["id"], i, p["chunks"][i - 1] if i else None))
    out = {}
    for p in prompts:
        cs, t = p["chunks"], p["target"]
        tdoc = doc_of[cs[t]]
        f = []
        if any(doc_of[c] == tdoc and c != cs[t] for c in cs):
            f.append("distractor_same_doc")
        if any(doc_of[c] != tdoc for c in cs):
            f.append("distractor_other_doc")
        if len(set(cs)) < len(cs):
            f.append("repeated_chunk")
            if cs.count(cs[t]) > 1:
                f.append("repeated_target")
        if any((q, i, prev) != (p["id"], j, cs[j - 1] if j else None)
               for j, c in enumerate(cs) for q, i, prev in seen[c] if q != p["id"]):
            f.append("reordered")
        if any(set(o["chunks"]) == set(cs) and o["chunks"] != cs for o in prompts if o["id"] != p["id"]):
            f.append("permuted_set")
        f.append("target_first" if t == 0 else "target_last" if t == len(cs) - 1 else "target_middle")
        out[p["id"]] = f
    return out


def assemble(questions: list[dict], chunks: list[dict], tpl) -> list[dict]:
    """Lay out each question's prompt: its target chunk, distractors from the same document (often
    its neighbours) and from other documents of the same genre and split (often chunks that earlier
    prompts used too, so chunks recur at other positions), a repeated chunk in some prompts."""
    by_id = {c["id"]: c for c in chunks}
    doc_split = {d["id"]: d["split"] for d in read_jsonl(DATA / "documents.jsonl")}
    ntok = {c["id"]: len(tpl.chunk_ids(c["text"])) for c in chunks}
    usable = [c["id"] for c in chunks if ntok[c["id"]] >= MIN_CHUNK_TOKENS]
    used = collections.defaultdict(list)
    include = collections.defaultdict(list)  # prompt id -> targets of later prompts laid out "like" it
    avoid = collections.defaultdict(list)  # prompt id -> answers of those later prompts
    for q in questions:
        if "like" in q:
            include[q["like"]].append(q["target"])
            avoid[q["like"]].append(q["answer"].lower())
    prompts, by_pid = [], {}
    for qi, q in enumerate(questions):
        rng = random.Random(f"ragkv-blend-{q['id']}")
        tgt = by_id[q["target"]]
        doc, genre, split = tgt["doc"], tgt["genre"], doc_split[tgt["doc"]]
        ans = q["answer"].lower()
        ok = [c for c in usable if c != tgt["id"] and ans not in by_id[c]["text"].lower()
              and by_id[c]["genre"] == genre and doc_split[by_id[c]["doc"]] == split
              and (c in include[q["id"]] or not any(a in by_id[c]["text"].lower() for a in avoid[q["id"]]))]
        if "like" in q:  # the chunk set of another prompt, in another order
            picks = [c for c in dict.fromkeys(by_pid[q["like"]]["chunks"]) if c != tgt["id"]]
            assert tgt["id"] in by_pid[q["like"]]["chunks"], q["id"]
            assert all(c in ok for c in picks), f"{q['id']}: answer occurs in another chunk of {q['like']}"
        else:
            same = [c for c in ok if by_id[c]["doc"] == doc]
            other = [c for c in ok if by_id[c]["doc"] != doc]
            n = int(tgt["id"].rsplit("-", 1)[1])
            near = [c for c in same if abs(int(c.rsplit("-", 1)[1]) - n) == 1]
            must = include[q["id"]]
            assert all(c in ok for c in must), f"{q['id']}: answer occurs in a chunk it must include"
            same = [c for c in same if c not in must]
            other = [c for c in other if c not in must]
            near = [c for c in near if c not in must]
            n_same = min(len(same), rng.choice([0, 1, 1, 2, 2, 3]))
            picks = list(must) + rng.sample(near, min(len(near), rng.choice([0, 1, 1]), n_same))
            picks += rng.sample([c for c in same if c not in picks], max(0, n_same - len(picks) + len(must)))
            k = rng.randint(4, 8)
            reuse = [c for c in dict.fromkeys(used[(split, genre)]) if c in other]
            while len(picks) < k - 1:
                pool = reuse if reuse and rng.random() < 0.5 else other
                pool = [c for c in pool if c not in picks]
                if not pool:
                    break
                picks.append(rng.choice(pool))
            while len(picks) > 3 and _ntok(tpl, [by_id[c]["text"] for c in [tgt["id"], *picks]], q["question"]) > MAX_PROMPT_TOKENS:
                picks.pop()
            while len(picks) < 7 and _ntok(tpl, [by_id[c]["text"] for c in [tgt["id"], *picks]], q["question"]) < MIN_PROMPT_TOKENS:
                picks.append(rng.choice([c for c in other if c not in picks]))
        rng.shuffle(picks)
        where = q.get("position", ["first", "middle", "last"][qi % 3])
        pos = {"first": 0, "last": len(picks)}.get(where, rng.randint(1, max(1, len(picks) - 1)))
        order = [*picks[:pos], tgt["id"], *picks[pos:]]
        target = pos
        if q.get("repeat"):  # the same chunk text twice: the target or a distractor
            dup = tgt["id"] if q["repeat"] == "target" else rng.choice(picks)
            while len(order) >= 8 or _ntok(tpl, [by_id[c]["text"] for c in [*order, dup]], q["question"]) > MAX_PROMPT_TOKENS:
                order.remove(next(c for c in order[::-1] if c not in (tgt["id"], dup)))
            i = order.index(dup)  # not next to the first copy
            order.insert(rng.choice([j for j in range(len(order) + 1) if j not in (i, i + 1)]), dup)
            target = order.index(tgt["id"])
        p = {"id": q["id"], "split": split, "genre": genre, "question": q["question"], "answer": q["answer"],
             "chunks": order, "target": target}
        prompts.append(p)
        by_pid[p["id"]] = p
        used[(split, genre)].extend(order)
    feats = features(prompts, {c["id"]: c["doc"] for c in chunks})
    for p in prompts:
        p["features"] = feats[p["id"]]
    return prompts


# ---------------------------------------------------------------- checks

def check(tpl, work: Path | None = None) -> int:
    from ragkv.chunking import chunk_document

    errors, warnings = [], []
    docs = read_jsonl(DATA / "documents.jsonl")
    chunks = read_jsonl(DATA / "chunks.jsonl")
    prompts = read_jsonl(DATA / "prompts.jsonl")
    by_id = {c["id"]: c for c in chunks}
    if len(by_id) != len(chunks):
        errors.append("duplicate chunk ids")
    if len({c["text"] for c in chunks}) != len(chunks):
        warnings.append("two chunks have the same text")
    # 1. chunks are exactly chunk_document's output for their document
    stored = collections.defaultdict(list)
    for c in chunks:
        stored[c["doc"]].append(c)
    for d in docs:
        got = chunk_document(d["text"], tpl, CHUNK_TOKENS)
        mine = stored.pop(d["id"], [])
        if [c["text"] for c in mine] != got or [c["id"] for c in mine] != [f"{d['id']}-{i}" for i in range(len(got))]:
            errors.append(f"{d['id']}: chunks.jsonl differs from chunk_document(text, template, {CHUNK_TOKENS})")
        if any(c["genre"] != d["genre"] or not c["id"].startswith(d["genre"] + "-") for c in mine):
            errors.append(f"{d['id']}: genre mismatch")
    errors += [f"chunks of unknown document {k}" for k in stored]
    print(f"chunks: {len(chunks)} chunks of {len(docs)} documents re-chunked with chunk_document: "
          f"{'identical' if not any('differs' in e for e in errors) else 'DIFFERENT'}")
    # 2. documents still match their sources (needs the .deb files, see the top of this file)
    if work is not None:
        fresh = {d["id"]: d for d in build_texts(work)}
        diff = [d["id"] for d in docs if fresh.get(d["id"], {}).get("text") != d["text"]]
        if diff:
            errors.append(f"documents differ from a rebuild from sources: {diff}")
        print(f"sources: {len(docs) - len(diff)}/{len(docs)} documents identical to a rebuild from the sources")
    # 3. prompts
    split_of = {d["id"]: d["split"] for d in docs}
    ids = [p["id"] for p in prompts]
    if len(set(ids)) != len(ids):
        errors.append("duplicate prompt ids")
    feats = features(prompts, {c["id"]: c["doc"] for c in chunks})
    lengths = collections.defaultdict(list)
    for p in prompts:
        pid, cs = p["id"], p["chunks"]
        if any(c not in by_id for c in cs):
            errors.append(f"{pid}: unknown chunk id")
            continue
        if not 4 <= len(cs) <= 8:
            errors.append(f"{pid}: {len(cs)} chunks")
        if not 0 <= p["target"] < len(cs):
            errors.append(f"{pid}: target out of range")
            continue
        texts = [by_id[c]["text"] for c in cs]
        tgt = by_id[cs[p["target"]]]
        if p["answer"].strip().lower() not in tgt["text"].lower():
            errors.append(f"{pid}: answer {p['answer']!r} not in its target chunk")
        dup = [c for c in set(cs) - {tgt["id"]} if p["answer"].strip().lower() in by_id[c]["text"].lower()]
        if dup:
            warnings.append(f"{pid}: answer also occurs in {dup}")
        if {split_of[by_id[c]["doc"]] for c in cs} != {p["split"]}:
            errors.append(f"{pid}: chunks from another split")
        if {by_id[c]["genre"] for c in cs} != {p["genre"]}:
            errors.append(f"{pid}: chunks from another genre")
        short = [c for c in cs if len(tpl.chunk_ids(by_id[c]["text"])) < MIN_CHUNK_TOKENS]
        if short:
            errors.append(f"{pid}: chunks under {MIN_CHUNK_TOKENS} tokens: {short}")
        n = tpl.build(p["question"], texts).num_tokens
        lengths[p["split"]].append(n)
        if n > 4096:
            errors.append(f"{pid}: {n} tokens > 4096")
        elif not MIN_PROMPT_TOKENS <= n <= MAX_PROMPT_TOKENS:
            warnings.append(f"{pid}: {n} tokens")
        if sorted(p["features"]) != sorted(feats[pid]):
            errors.append(f"{pid}: features {p['features']} != computed {feats[pid]}")
        if not p["question"].strip().endswith("?"):
            warnings.append(f"{pid}: question does not end with '?'")
    docs_by_split = collections.defaultdict(set)
    for p in prompts:
        docs_by_split[p["split"]].update(by_id[c]["doc"] for c in p["chunks"])
    if docs_by_split["dev"] & docs_by_split["test"]:
        errors.append(f"documents in both splits: {docs_by_split['dev'] & docs_by_split['test']}")
    count = collections.Counter((p["split"], p["genre"]) for p in prompts)
    genres = sorted({p["genre"] for p in prompts})
    if sum(v for (s, _), v in count.items() if s == "dev") < 24:
        errors.append("dev has fewer than 24 prompts")
    if any(count[("test", g)] < 12 for g in genres) or len(genres) < 3:
        errors.append("test needs at least 12 prompts in each of at least 3 genres")
    for s in ("dev", "test"):
        ls = sorted(lengths[s])
        print(f"{s}: {len(ls)} prompts, " + ", ".join(f"{g} {count[(s, g)]}" for g in genres)
              + f"; prompt tokens min {ls[0]} median {ls[len(ls) // 2]} max {ls[-1]}")
    for w in warnings:
        print("warning:", w)
    for e in errors:
        print("ERROR:", e)
    print(f"{len(errors)} errors, {len(warnings)} warnings")
    return 1 if errors else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("step", choices=["texts", "prompts", "check"])
    ap.add_argument("--work", type=Path, help="folder for the downloaded .deb files and their contents")
    a = ap.parse_args()
    tpl = template()
    if a.step == "texts":
        docs = build_texts(a.work or Path("/tmp/corpus-work/build"))
        write_jsonl(DATA / "documents.jsonl", docs)
        write_jsonl(DATA / "chunks.jsonl", chunk_docs(docs, tpl))
        print(f"wrote {len(docs)} documents to documents.jsonl and their chunks to chunks.jsonl")
    elif a.step == "prompts":
        prompts = assemble(read_jsonl(DATA / "questions.jsonl"), read_jsonl(DATA / "chunks.jsonl"), tpl)
        write_jsonl(DATA / "prompts.jsonl", prompts)
        print(f"wrote {len(prompts)} prompts to prompts.jsonl")
    else:
        return check(tpl, a.work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
