//! Helpers for end-to-end tests: start real zebu processes, wait for them, clean up.
