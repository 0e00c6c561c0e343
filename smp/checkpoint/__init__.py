"""Framework-free checkpoint mechanics: atomic files, per-save manifests, the commit of a save directory.

`names` holds the SMP v1 file names. The save_checkpoint layout and the torch serialisation live in
the frontends (``smp.torch.checkpoint_files``);
they pass their writers in as callables (``write(file)``) and read back through `verify_file`.
"""

from smp.checkpoint.atomic import TEMP_SUFFIX, FileRecord, atomic_write, fsync_dir, makedirs, sha256_file
from smp.checkpoint.manifest import (
    MANIFEST,
    Leftover,
    Manifest,
    clean_leftovers,
    commit_directory,
    committed_directory,
    find_leftovers,
    new_save_id,
    old_directory,
    read_manifest,
    staging_directory,
    verify_file,
    write_manifest,
)

__all__ = [
    "MANIFEST", "TEMP_SUFFIX", "FileRecord", "Leftover", "Manifest", "atomic_write", "clean_leftovers", "commit_directory",
    "committed_directory", "find_leftovers", "fsync_dir", "makedirs", "new_save_id", "old_directory",
    "read_manifest", "sha256_file", "staging_directory", "verify_file", "write_manifest",
]
