//! Task management (RFC 7143 §11.5-11.6): ABORT TASK, ABORT TASK SET, LUN and target
//! resets. An abort marks the running commands it hits and drops the writes still waiting
//! for Data-Out; its response waits until every aborted command has finished its device
//! I/O (see the parent module's docs), and at most [`MAX_PENDING_TMFS`] responses wait at
//! once per connection.

use tracing::{debug, info};

use super::{CmdId, LUN1, MAX_PENDING_TMFS, Session, Sn};
use crate::iscsi::pdu::{Bhs, op};

/// A task management response waiting for the commands it aborted to finish.
pub(super) struct PendingTmf {
    pub(super) itt: u32,
    pub(super) response: u8,
    pub(super) victims: Vec<CmdId>,
    /// TARGET COLD RESET: the connection ends after the response.
    pub(super) close: bool,
}

impl Session<'_> {
    /// Removes a write still waiting for Data-Out; true if there was one.
    pub(super) fn drop_pending_write(&mut self, itt: u32) -> bool {
        match self.writes.remove(&itt) {
            Some(w) => {
                self.release(&w.cmd);
                true
            }
            None => false,
        }
    }

    pub(super) fn task_mgmt(&mut self, bhs: Bhs) {
        if !self.accept_cmd_sn(&bhs) {
            return;
        }
        if self.tmfs.len() >= MAX_PENDING_TMFS {
            debug!(initiator = %self.initiator, "task management requests at their limit");
            let mut b = Bhs::new(op::TASK_MGMT_RESP);
            b.0[1] = 0x80;
            b.0[2] = 255; // function rejected: nothing was done
            b.set_itt(bhs.itt());
            self.send_copy(b, &[], Sn::Advance);
            return;
        }
        let function = bhs.flags() & 0x7f;
        let rtt = bhs.u32_at(20);
        let ref_cmd_sn = bhs.u32_at(32);
        let lun_ok = bhs.lun() == LUN1;
        let mut victims = Vec::new();
        let response: u8 = match function {
            1 => {
                let pending = self.drop_pending_write(rtt);
                if let Some(t) = self.tasks.get_mut(&rtt) {
                    t.aborted = true;
                    victims.push(t.id);
                    0
                } else if pending {
                    0
                } else {
                    // With one connection per session every earlier command has arrived, so
                    // a task we do not know has already completed.
                    debug!(ref_cmd_sn, "ABORT TASK for an unknown task");
                    1
                }
            }
            2 | 4 | 5 if !lun_ok => 2,
            2 | 4 | 5 | 6 | 7 => {
                let itts: Vec<u32> = self.writes.keys().copied().collect();
                for itt in itts {
                    self.drop_pending_write(itt);
                }
                for t in self.tasks.values_mut() {
                    t.aborted = true;
                    victims.push(t.id);
                }
                0
            }
            8 => 4,
            _ => 5,
        };
        info!(
            function,
            rtt,
            response,
            aborted = victims.len(),
            "task management"
        );
        self.tmfs.push(PendingTmf {
            itt: bhs.itt(),
            response,
            victims,
            close: function == 7,
        });
        self.answer_tmfs();
    }

    /// Sends the response of every task management request whose aborted commands have all
    /// finished.
    pub(super) fn answer_tmfs(&mut self) {
        let mut i = 0;
        while i < self.tmfs.len() {
            if !self.tmfs[i].victims.is_empty() {
                i += 1;
                continue;
            }
            let t = self.tmfs.remove(i);
            let mut b = Bhs::new(op::TASK_MGMT_RESP);
            b.0[1] = 0x80;
            b.0[2] = t.response;
            b.set_itt(t.itt);
            self.send_copy(b, &[], Sn::Advance);
            if t.close {
                self.stop_reading();
            }
        }
    }
}
