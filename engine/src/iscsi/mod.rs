//! iSCSI target (in progress).
