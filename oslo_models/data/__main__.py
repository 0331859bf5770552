"""``python -m oslo_models.data preprocess|info ...``: build and inspect ``.bin/.idx`` token corpora."""
from __future__ import annotations

import argparse
import json
import sys


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m oslo_models.data", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    pre = sub.add_parser("preprocess", help="tokenize a corpus into PREFIX.bin + PREFIX.idx")
    pre.add_argument("--input", required=True, nargs="+", help="text/jsonl/json/parquet/csv files or folders")
    pre.add_argument("--output", required=True, help="output prefix: writes OUTPUT.bin and OUTPUT.idx")
    pre.add_argument("--tokenizer", required=True, help="tokenizer folder or Hub name (AutoTokenizer)")
    pre.add_argument("--text-field", default="text", help="column with the text (default: text)")
    pre.add_argument("--input-format", choices=["text", "json", "parquet", "csv"], default=None,
                     help="override the format guessed from the file extension")
    pre.add_argument("--workers", type=int, default=1, help="tokenizer processes (datasets map num_proc)")
    pre.add_argument("--batch-size", type=int, default=1000, help="documents per tokenizer call")
    pre.add_argument("--no-eos", action="store_true", help="do not append EOS to every document")
    pre.add_argument("--add-special-tokens", action="store_true", help="let the tokenizer add BOS/CLS/...")
    pre.add_argument("--cache-dir", default=None, help="datasets cache folder (default: the HF cache)")
    pre.add_argument("--quiet", action="store_true", help="no progress bars")

    info = sub.add_parser("info", help="print the header of PREFIX.idx and check PREFIX.bin")
    info.add_argument("prefix")
    return parser


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "preprocess":
            from .preprocessing import preprocess

            header = preprocess(args.input, args.output, args.tokenizer, text_field=args.text_field,
                                workers=args.workers, batch_size=args.batch_size, append_eos=not args.no_eos,
                                add_special_tokens=args.add_special_tokens, input_format=args.input_format,
                                show_progress=not args.quiet, cache_dir=args.cache_dir)
            print(f"wrote {args.output}.bin and {args.output}.idx: {header['num_documents']} documents, "
                  f"{header['num_tokens']} tokens ({header['dtype']})")
        else:
            from .indexed import MMapTokenDataset

            ds = MMapTokenDataset(args.prefix)
            print(json.dumps(ds.header, indent=2, sort_keys=True))
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
