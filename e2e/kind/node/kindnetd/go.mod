module spotrl.local/e2e/kindnetd

go 1.25.0
