"""``ipu-emulator cleanup``: remove shared-memory objects whose creator is dead, and
(``--temp-files FOLDER``) the temporary files killed writers left in a folder."""

from __future__ import annotations

import argparse
import os
import sys

from ipu_emulator import safe_files

from shm import naming
from shm.cleanup import list_objects, remove_dead


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="ipu-emulator cleanup",
        description="Remove /dev/shm segments and semaphores of ours (prefix "
                    f"'{naming.PREFIX}_') whose creating process is dead.")
    parser.add_argument("--all-tags", action="store_true",
                        help="every tag, not only IPU_EMULATOR_SHM_TAG's")
    parser.add_argument("--tag", default=None,
                        help="the tag to clean (default: IPU_EMULATOR_SHM_TAG or 'g')")
    parser.add_argument("--dry-run", action="store_true",
                        help="only report what would be removed")
    parser.add_argument("--temp-files", metavar="FOLDER", action="append", default=[],
                        help="also remove the temporary files (.NAME.<hex>.tmp) a killed "
                             "poprt or writer left in FOLDER (repeatable); only this user's, "
                             "whose writer is gone")
    args = parser.parse_args(argv)
    for folder in args.temp_files:
        try:
            gone = (safe_files.stale_temps(folder) if args.dry_run
                    else safe_files.remove_stale_temps(folder))
        except OSError as exc:
            print(f"ipu-emulator cleanup: error: {folder}: {exc.strerror or exc}",
                  file=sys.stderr)
            return 1
        for name in gone:
            print(f"{'would remove' if args.dry_run else 'removed'} "
                  f"{os.path.join(os.path.abspath(folder), name)}")
    tag = args.tag if args.tag is not None else naming.current_tag()
    scope = "all tags" if args.all_tags else f"tag {tag!r}"
    by_entry = {o.entry: o for o in list_objects(tag, args.all_tags)}
    removed = remove_dead(tag, all_tags=args.all_tags, dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    for entry in removed:
        obj = by_entry.get(entry)
        what = "semaphore" if entry.startswith("sem.") else "segment"
        pid = f" (creator pid {obj.pid} is dead)" if obj is not None else ""
        print(f"{verb} {what} {naming.SHM_DIR}/{entry}{pid}")
    kept = len(by_entry) - len(removed)
    print(f"{verb} {len(removed)} object(s) of {scope}; "
          f"kept {kept} whose creator is alive")
    return 0


if __name__ == "__main__":
    sys.exit(main())
