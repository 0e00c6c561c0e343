"""Framework-free checkpoint mechanics: atomic files, per-save manifests, the commit of a save directory.

`names` holds the SMP v1 file names of ``smp.save``; `layout` the save_checkpoint layout (``newest``,
``<tag>_partial/``, the staged and committed partial save, reading back). A frontend passes its
serialisation in as a `Codec` (``smp.torch.checkpointing.files`` binds ``torch.save``/``torch.load``);
every file is written by `atomic_write` and read back through `load_file`, checked by `verify_file`.
"""

from smp.checkpoint.atomic import (
    TEMP_SUFFIX,
    FileRecord,
    atomic_write,
    atomic_write_text,
    fsync_dir,
    makedirs,
    sha256_file,
)
from smp.checkpoint.codec import Codec, load_file
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
    "MANIFEST", "TEMP_SUFFIX", "Codec", "FileRecord", "Leftover", "Manifest", "atomic_write", "atomic_write_text",
    "clean_leftovers", "commit_directory", "committed_directory", "find_leftovers", "fsync_dir", "load_file",
    "makedirs", "new_save_id", "old_directory", "read_manifest", "sha256_file", "staging_directory",
    "verify_file", "write_manifest",
]
