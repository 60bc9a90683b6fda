module spotrl.local/e2e/pause

go 1.25.0
