// The few settings of the page that one module sets and others read while it runs; everything
// else a module needs it imports as a function or an object (the record store is socket.js's,
// the view and the viewer's own rows are layout.js's).
export const state = {
  role: "lecturer",   // the stage's data-role (main.js): lecturer | student | projector | replay
  offline: false,     // no socket: a recorded stream is fed through ingestAll (a replay page, a test)
  chartScale: 1,      // drawing units per CSS px (the projector draws everything bigger: room.js)
  chartMaxH: 420,     // px (CSS) the Gantt may grow to (lesson.js fits it to the screen, room.js per role)
  lessonStart: null,  // .step where the pressed lesson's steps begin (lesson.js; the what-if panel replays from it)
};

// The animation loop's wake-up (main.js sets it): a module that gets news while the loop idles
// (socket.js: a message; a trace fed in) calls loop.wake() so that the next frame comes at once.
export const loop = { wake() {} };
