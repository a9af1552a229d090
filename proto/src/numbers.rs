//! The counters that order an engine's work on its replicas, as types: [`Generation`]
//! (fences older engines), [`Epoch`] (numbers a membership) and [`FlushNumber`] (numbers a
//! durable point). All three only grow, and all three arrive from the wire, where a peer may
//! send any u64: a value near `u64::MAX` accepted once would leave no room to grow, and the
//! next `+ 1` would wrap (or panic) and make the replica unservable for good.
//!
//! So both sides go through one rule: the next value is taken with [`Generation::checked_next`]
//! (and its siblings), which refuses to reach [`u64::MAX`], and a receiver accepts an offered
//! value only if it is at most [`MAX_JUMP`] above the one it holds ([`Generation::accepts`]).
//! 2^32 is far beyond any real gap (a generation per engine start, a flush number per flush:
//! four billion flushes missed by one replica) and still leaves 2^32 such jumps before the
//! ceiling.

use std::fmt;

/// How far above the current value an offered one may be.
pub const MAX_JUMP: u64 = 1 << 32;

/// Whether `offered` is not implausibly far above `current` (it may be lower: whether a
/// lower one is acceptable is the caller's rule, e.g. a stale generation).
pub fn within_jump(current: u64, offered: u64) -> bool {
    offered <= current.saturating_add(MAX_JUMP) && offered < u64::MAX
}

/// Why a counter cannot take a value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CounterError {
    #[error("{what} {current} has no successor (at the ceiling)")]
    Exhausted { what: &'static str, current: u64 },
    #[error(
        "{what} {offered} is implausibly far above the current {current} (more than {MAX_JUMP} \
         ahead); refused"
    )]
    TooFarAhead {
        what: &'static str,
        current: u64,
        offered: u64,
    },
}

macro_rules! counter {
    ($name:ident, $what:literal, $doc:literal) => {
        #[doc = $doc]
        #[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
        pub struct $name(pub u64);

        impl $name {
            pub const WHAT: &'static str = $what;

            /// The value after this one, or an error at the ceiling (`u64::MAX` is never
            /// reached, so every accepted value has a successor).
            pub fn checked_next(self) -> Result<$name, CounterError> {
                match self.0.checked_add(1) {
                    Some(n) if n < u64::MAX => Ok($name(n)),
                    _ => Err(CounterError::Exhausted {
                        what: $what,
                        current: self.0,
                    }),
                }
            }

            /// Checks an offered value against this (the current) one: refused when it is
            /// more than [`MAX_JUMP`] above it, or at the ceiling.
            pub fn accepts(self, offered: $name) -> Result<(), CounterError> {
                if within_jump(self.0, offered.0) {
                    Ok(())
                } else {
                    Err(CounterError::TooFarAhead {
                        what: $what,
                        current: self.0,
                        offered: offered.0,
                    })
                }
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{} {}", $what, self.0)
            }
        }
    };
}

counter!(
    Generation,
    "generation",
    "An engine's generation: a replica serves only the highest it accepted."
);
counter!(
    Epoch,
    "epoch",
    "A membership epoch: the set of current replicas, recorded by each of them."
);
counter!(
    FlushNumber,
    "flush number",
    "A flush's number: every write before it is durable once it completes."
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn next_refuses_the_ceiling() {
        assert_eq!(Generation(1).checked_next(), Ok(Generation(2)));
        assert!(Generation(u64::MAX - 1).checked_next().is_err());
        assert!(FlushNumber(u64::MAX).checked_next().is_err());
        assert_eq!(Epoch(u64::MAX - 2).checked_next(), Ok(Epoch(u64::MAX - 1)));
    }

    #[test]
    fn accepts_bounded_jumps_only() {
        assert!(Generation(5).accepts(Generation(6)).is_ok());
        assert!(
            Generation(5).accepts(Generation(1)).is_ok(),
            "lower is the caller's rule"
        );
        assert!(Generation(0).accepts(Generation(MAX_JUMP)).is_ok());
        assert!(Generation(0).accepts(Generation(MAX_JUMP + 1)).is_err());
        assert!(FlushNumber(7).accepts(FlushNumber(u64::MAX)).is_err());
        assert!(Epoch(u64::MAX - 1).accepts(Epoch(u64::MAX)).is_err());
        let e = Epoch(3).accepts(Epoch(u64::MAX)).unwrap_err().to_string();
        assert!(
            e.contains("epoch 18446744073709551615") && e.contains("current 3"),
            "{e}"
        );
    }
}
