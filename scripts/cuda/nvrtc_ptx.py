#!/usr/bin/env python3
"""Compile a .cu file to PTX with NVRTC through ctypes (no CUDA toolkit, no GPU).

usage: nvrtc_ptx.py LIBNVRTC SRC.cu ARCH OUT.ptx    (ARCH: 80, 90, ...)

The program is named after the source file's base name, so the PTX does not depend on where
the checkout lives. Exits non-zero with NVRTC's log on a compile error.
"""
import ctypes
import os
import sys


def check(lib, res, what, prog=None):
    if res != 0:
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        msg = lib.nvrtcGetErrorString(res).decode()
        log = ""
        if prog is not None:
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            buf = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(prog, buf)
            log = buf.value.decode(errors="replace")
        sys.exit(f"nvrtc: {what} failed: {msg}\n{log}")


def main():
    if len(sys.argv) != 5:
        sys.exit(__doc__)
    libpath, src_path, arch, out = sys.argv[1:]
    lib = ctypes.CDLL(libpath)
    with open(src_path, "rb") as f:
        src = f.read()
    prog = ctypes.c_void_p()
    name = os.path.basename(src_path).encode()
    check(lib, lib.nvrtcCreateProgram(ctypes.byref(prog), src, name, 0, None, None), "create")
    opts = [f"--gpu-architecture=compute_{arch}".encode(), b"--std=c++17", b"-default-device"]
    arr = (ctypes.c_char_p * len(opts))(*opts)
    check(lib, lib.nvrtcCompileProgram(prog, len(opts), arr), "compile", prog)
    size = ctypes.c_size_t()
    check(lib, lib.nvrtcGetPTXSize(prog, ctypes.byref(size)), "PTX size")
    buf = ctypes.create_string_buffer(size.value)
    check(lib, lib.nvrtcGetPTX(prog, buf), "PTX")
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    with open(out, "wb") as f:
        f.write(buf.value)


if __name__ == "__main__":
    main()
