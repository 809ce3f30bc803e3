#!/bin/sh
# CRIU's action script of a held restore (coldsnap.snapshot.replica_launcher.UnlockHold): at post-restore, with
# the tree restored and its TCP connections still in repair mode, tell the launcher and wait for its word.
[ "$CRTOOLS_SCRIPT_ACTION" = post-restore ] || exit 0
echo restored > "$COLDSNAP_UNLOCK_HOLD/unlock-restored"
read -r answer < "$COLDSNAP_UNLOCK_HOLD/unlock-go"
[ "$answer" = go ]
