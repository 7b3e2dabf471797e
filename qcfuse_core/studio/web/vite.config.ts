// Builds the page into ../static, which ships inside the Python package (users need no Node).
// `npm run dev` serves it with hot reload and forwards /api to a running `qcfuse studio`.
import react from "@vitejs/plugin-react";
import { defineConfig } from "vite";

export default defineConfig({
  plugins: [react()],
  base: "/",
  build: {
    outDir: "../static",
    emptyOutDir: true,
    assetsInlineLimit: 0, // fonts stay files (no data: URLs), cached by the browser
    sourcemap: false,
  },
  server: {
    host: "127.0.0.1",
    proxy: { "/api": "http://127.0.0.1:8501" },
  },
});
