"""Write o200k_base.tiktoken (OpenAI's o200k vocabulary in tiktoken's file format) from the one carried
by the PyPI wheel quicktok-v1 (quicktok/data/o200k.vocab), with nothing but the standard library.

Why: sglang-router 0.3.2 in IGW mode (--enable-igw, the only mode that routes by the request's model)
loads this vocabulary at start-up through the openai-harmony crate, which downloads it from
openaipublic.blob.core.windows.net unless TIKTOKEN_ENCODINGS_BASE names a folder holding it, and
panics ("Failed to load Harmony encoding") when it cannot; it checks the file's sha256 either way.

quicktok's table: a little-endian u32 count, then per token a u16 length, the token's bytes and a u32
rank. tiktoken's file: one line per token, "<base64 of the bytes> <rank>\\n", in the table's order.

    python3 o200k_tiktoken.py WHEEL OUT_DIR SHA256
"""
import base64
import hashlib
import os
import struct
import sys
import zipfile

MEMBER = "quicktok/data/o200k.vocab"
NAME = "o200k_base.tiktoken"


def tiktoken_text(table: bytes) -> bytes:
    (count,), pos, lines = struct.unpack_from("<I", table, 0), 4, []
    for _ in range(count):
        (length,) = struct.unpack_from("<H", table, pos)
        token = table[pos + 2:pos + 2 + length]
        (rank,) = struct.unpack_from("<I", table, pos + 2 + length)
        pos += 6 + length
        lines.append(b"%s %d\n" % (base64.b64encode(token), rank))
    return b"".join(lines)


def main(argv: list[str]) -> int:
    wheel, out_dir, want = argv
    data = tiktoken_text(zipfile.ZipFile(wheel).read(MEMBER))
    got = hashlib.sha256(data).hexdigest()
    if got != want:
        print(f"{NAME} from {wheel}: sha256 {got}, the router wants {want}", file=sys.stderr)
        return 1
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, NAME + ".tmp"), "wb") as f:
        f.write(data)
    os.replace(os.path.join(out_dir, NAME + ".tmp"), os.path.join(out_dir, NAME))
    print(f"{NAME}: {len(data)} bytes, sha256 {got} (as the router checks)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
