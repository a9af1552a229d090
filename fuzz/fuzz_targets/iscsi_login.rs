//! Login and text key negotiation: the `key=value` parser and per-key negotiation on the raw
//! input, then the login state machine over Login Request PDUs built from the same input,
//! then the full feature phase's Text exchange over Text Requests built from it.
//! See `zebu_engine::iscsi::fuzzing::{text_keys, login_exchange, text_exchange}`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    zebu_engine::iscsi::fuzzing::text_keys(data);
    zebu_engine::iscsi::fuzzing::login_exchange(data);
    zebu_engine::iscsi::fuzzing::text_exchange(data);
});
