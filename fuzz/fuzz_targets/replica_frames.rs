//! A real replica server's frames connection fed arbitrary bytes as the client's stream:
//! hello, fencing, volume identity and every request executed against a replica on disk.
//! See `zebu_replica::server::fuzzing::frames_connection`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    zebu_replica::server::fuzzing::frames_connection(data);
});
